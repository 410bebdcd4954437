"""The Triton tensor interface of model `llm` (vllm_backend-compatible), as pure functions over numpy arrays.

`parse_request` turns input tensors into an engine request; `ResponseBuilder` turns engine outputs into
output tensors, streaming deltas or one final response. No Triton import here: model.py does the I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.parameters import SamplingParams
from tritonllm.interface.tensors import (CANCEL_INPUT, CANCEL_OUTPUT, CHAT_ROLES, RETURN_FLAGS, RUNNING,
                                        chat_template_conflict, message_text)
from tritonllm.interface.tools import template_message, tool_spec
from tritonllm.engine.processing.input_processor import PromptOptions, TokenizedPrompt
from tritonllm.engine.processing.outputs import RequestOutput, TokenLogprob
from tritonllm.engine.processing.tool_calls import merge_tool_call_deltas


@dataclass
class ParsedRequest:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages the engine renders with its template
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    returns: set[str] = field(default_factory=set)  # output names requested besides text_output
    options: PromptOptions = PromptOptions()
    tokenize_only: bool = False  # answer with the prompt's tokens (tokenized_tensors), generate nothing


def _scalar(array: np.ndarray | None, name: str):
    if array is None:
        return None
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"input {name} must hold exactly one element, got {flat.size}")
    return flat[0]


def _text(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"input {name} is not valid UTF-8") from None
    return str(value)


def _messages(raw: str) -> list[dict]:
    """The `messages` input: a JSON list of {role, content} chat messages (content: a string or text parts; an
    assistant's tool_calls, a tool result's tool_call_id)."""
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"input messages is not valid JSON: {error}") from None
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("input messages must be a non-empty JSON list of {role, content} objects")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{index}] must be an object with a role in {list(CHAT_ROLES)} "
                                 "and a string content")
        try:
            # Only the keys of template_message reach the chat template: others would change the rendering
            # unnoticed.
            rendered.append(template_message(message, index, message_text))
        except ValueError as error:
            raise InvalidRequest(str(error), "messages") from None
    return rendered


def _prompt(inputs: dict[str, np.ndarray | None]) -> str | list[int] | list[dict]:
    input_ids = inputs.get("input_ids")
    has_ids = input_ids is not None and np.asarray(input_ids).size > 0
    text = _scalar(inputs.get("text_input"), "text_input")
    messages = _scalar(inputs.get("messages"), "messages")
    if messages is not None:
        if has_ids or text is not None:
            raise InvalidRequest("give exactly one of text_input, input_ids and messages")
        return _messages(_text(messages, "messages"))
    # input_ids taking precedence over text_input is vllm_backend's behaviour, kept for its clients.
    if has_ids:
        return [int(t) for t in np.asarray(input_ids).reshape(-1)]
    if text is not None:
        return _text(text, "text_input")
    raise InvalidRequest("the request needs a prompt: text_input, input_ids or messages")


def _flag(inputs: dict[str, np.ndarray | None], name: str) -> bool | None:
    """A BOOL input's value; None when absent."""
    value = _scalar(inputs.get(name), name)
    return None if value is None else bool(value)


def _options(inputs: dict[str, np.ndarray | None]) -> PromptOptions:
    add_generation_prompt = _flag(inputs, "add_generation_prompt") is not False  # (default true)
    continue_final_message = bool(_flag(inputs, "continue_final_message"))
    conflict = chat_template_conflict(add_generation_prompt, continue_final_message)
    if conflict:
        raise InvalidRequest(conflict, "continue_final_message")
    raw_kwargs = _scalar(inputs.get("chat_template_kwargs"), "chat_template_kwargs")
    kwargs = {}
    if raw_kwargs is not None:
        try:
            kwargs = json.loads(_text(raw_kwargs, "chat_template_kwargs"))
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"chat_template_kwargs is not valid JSON: {error}", "chat_template_kwargs") from None
        if not isinstance(kwargs, dict):
            raise InvalidRequest("chat_template_kwargs must be a JSON object", "chat_template_kwargs")
    return PromptOptions(add_special_tokens=_flag(inputs, "add_special_tokens"),
                         add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                         chat_template_kwargs=kwargs, tools=_tools(inputs))


def _tools(inputs: dict[str, np.ndarray | None]):
    """The TOOL_INPUTS as a ToolSpec (None without tools)."""
    raw_tools = _scalar(inputs.get("tools"), "tools")
    tools = None
    if raw_tools is not None:
        try:
            tools = json.loads(_text(raw_tools, "tools"))
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"tools is not valid JSON: {error}", "tools") from None
    raw_choice = _scalar(inputs.get("tool_choice"), "tool_choice")
    choice = None if raw_choice is None else _text(raw_choice, "tool_choice")
    if choice is not None and choice.lstrip().startswith("{"):  # a named function
        try:
            choice = json.loads(choice)
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"tool_choice is not valid JSON: {error}", "tool_choice") from None
    spec = tool_spec(tools, choice, _flag(inputs, "parallel_tool_calls"))
    if spec is not None and _scalar(inputs.get("messages"), "messages") is None:
        raise InvalidRequest("tools need a chat: send messages", "tools")
    return spec


def parse_request(inputs: dict[str, np.ndarray | None]) -> ParsedRequest:
    """inputs: tensor name → numpy array (None when the client did not send it)."""
    prompt = _prompt(inputs)
    raw_params = _scalar(inputs.get("sampling_parameters"), "sampling_parameters")
    params = SamplingParams.from_json(None if raw_params is None else _text(raw_params, "sampling_parameters"))
    flags = {name: bool(_flag(inputs, name)) for name in ("stream", "exclude_input_in_output", "tokenize_only")
             + RETURN_FLAGS}
    if flags["stream"]:
        params.check_streamable()
        # A stream carries only new text; vllm_backend refuses an explicit request for the prompt in it.
        if inputs.get("exclude_input_in_output") is not None and not flags["exclude_input_in_output"]:
            raise InvalidRequest("exclude_input_in_output false cannot be streamed: streamed responses carry only "
                                 "new text (leave it out or set it true)")
    return ParsedRequest(
        prompt=prompt, params=params, stream=flags["stream"],
        exclude_input_in_output=flags["exclude_input_in_output"],
        returns={name.removeprefix("return_") for name in RETURN_FLAGS if flags[name]},
        options=_options(inputs), tokenize_only=flags["tokenize_only"],
    )


def cancel_target(inputs: dict[str, np.ndarray | None]) -> str | None:
    """The Triton request id a cancel request names (CANCEL_INPUT), or None for any other request."""
    target = _scalar(inputs.get(CANCEL_INPUT), CANCEL_INPUT)
    if target is None:
        return None
    if not (target := _text(target, CANCEL_INPUT)):
        raise InvalidRequest(f"{CANCEL_INPUT} must name a request: it is empty")
    return target


def instance_tensors(instance: str) -> dict[str, np.ndarray]:
    """The first response of a request that asked for return_model_instance."""
    return {"model_instance": np.array([instance.encode()], dtype=np.object_)}


def cancel_tensors(cancelled: bool) -> dict[str, np.ndarray]:
    """The one response of a cancel request."""
    return {CANCEL_OUTPUT: np.array([cancelled], dtype=np.bool_)}


def tokenized_tensors(tokenized: TokenizedPrompt, max_model_len: int) -> dict[str, np.ndarray]:
    """The one response of a tokenize_only request (TOKENIZE_OUTPUTS)."""
    return {
        "text_output": np.array([tokenized.text.encode("utf-8")], dtype=np.object_),
        "prompt_token_ids": np.array(tokenized.token_ids, dtype=np.int32),
        "prompt_token_strs": np.array([text.encode("utf-8") for text in tokenized.token_strs], dtype=np.object_),
        "num_input_tokens": np.array([len(tokenized.token_ids)], dtype=np.uint32),
        "max_model_len": np.array([max_model_len], dtype=np.uint32),
    }


def _logprob_entry(lp: TokenLogprob) -> dict:
    """vllm_backend's entry of one token: token id → {logprob, rank, decoded_token}, the token itself first, then
    its most likely alternatives (a token that is one of them appears once)."""
    entry = {lp.token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}}
    for rank, (token_id, text, logprob) in enumerate(lp.top, start=1):
        entry.setdefault(token_id, {"logprob": logprob, "rank": rank, "decoded_token": text})
    return entry


class ResponseBuilder:
    """Per request: engine outputs in, response tensors out (None while a non-streaming request runs, and while a
    streamed one gathers its next chunk: a response once a choice has `stream_interval` new tokens, the first and
    the last at once)."""

    def __init__(self, request: ParsedRequest, stream_interval: int = 1):
        self.request = request
        self.stream_interval = stream_interval
        self.streamed = False  # whether a streamed response went out yet
        count = request.params.num_sequences
        self.texts = [""] * count
        # A choice's state, in every response: RUNNING until it ends, then why it ended.
        self.finish_reasons = [RUNNING] * count
        self.matched_stops: list[str | int | None] = [None] * count
        self.logprobs: list[list] = [[] for _ in range(count)]
        self.cumulative_logprobs = [0.0] * count
        self.num_output_tokens = [0] * count
        self.num_reported_tokens = [0] * count  # streaming: tokens already sent (each response counts its own)
        self.prompt_logprobs: list | None = None
        self.prompt_token_ids: list[int] | None = None
        self.hidden_states: list[list] = [[] for _ in range(count)]
        self.prompt_hidden_states: list | None = None
        self.routed_experts: list[list] = [[] for _ in range(count)]
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.tool_calls: list[list[dict]] = [[] for _ in range(count)]  # streaming: deltas; else whole calls
        self.reasoning: list[str] | None = None  # a reasoning model's chat: each choice's reasoning text
        self.num_reasoning_tokens = [0] * count
        if not request.stream and not request.exclude_input_in_output and isinstance(request.prompt, str):
            self.texts = [request.prompt] * count

    def on_output(self, output: RequestOutput) -> dict[str, np.ndarray] | None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = [_logprob_entry(lp) for lp in output.prompt_logprobs]
        if output.prompt_token_ids is not None:
            self.prompt_token_ids = output.prompt_token_ids
        if output.prompt_hidden_states is not None:
            self.prompt_hidden_states = output.prompt_hidden_states.tolist()
        for delta in output.choices:
            i = delta.index
            self.texts[i] += delta.text
            self.logprobs[i].extend(map(_logprob_entry, delta.logprobs))
            self.hidden_states[i].extend(row.tolist() for row in delta.hidden_states)
            self.routed_experts[i].extend(experts.tolist() for experts in delta.routed_experts)
            self.token_ids[i].extend(delta.token_ids)
            if self.request.stream:
                self.tool_calls[i].extend(delta.tool_calls)
            else:
                merge_tool_call_deltas(self.tool_calls[i], delta.tool_calls)
            if delta.reasoning is not None:
                self.reasoning = self.reasoning or [""] * len(self.texts)
                self.reasoning[i] += delta.reasoning
                self.num_reasoning_tokens[i] = delta.num_reasoning_tokens
            self.cumulative_logprobs[i] = delta.cumulative_logprob
            self.num_output_tokens[i] = delta.num_output_tokens
            self.finish_reasons[i] = delta.finish_reason or RUNNING
            self.matched_stops[i] = delta.matched_stop
        if not self.request.stream:
            return self._tensors(output, self._kept_choices()) if output.finished else None
        unsent = max(made - sent for made, sent in zip(self.num_output_tokens, self.num_reported_tokens))
        if self.streamed and not output.finished and unsent < self.stream_interval:
            return None
        tensors = self._tensors(output, self._kept_choices())
        self._clear_sent()
        return tensors

    def _clear_sent(self) -> None:
        """After a streamed response: the next one carries only what is new."""
        count = self.request.params.num_sequences
        self.streamed = True
        self.num_reported_tokens = list(self.num_output_tokens)
        self.texts, self.logprobs = [""] * count, [[] for _ in range(count)]
        self.prompt_logprobs, self.prompt_hidden_states, self.prompt_token_ids = None, None, None
        self.hidden_states = [[] for _ in range(count)]
        self.routed_experts = [[] for _ in range(count)]
        self.token_ids = [[] for _ in range(count)]
        self.tool_calls = [[] for _ in range(count)]
        if self.reasoning is not None:
            self.reasoning = [""] * count

    def _kept_choices(self) -> list[int]:
        """All choices, or with best_of the n most likely (by cumulative logprob), best first (beam search's come
        best first already)."""
        count, n = self.request.params.num_sequences, self.request.params.n
        if count == n or self.request.params.use_beam_search:
            return list(range(n))
        return sorted(range(count), key=lambda i: self.cumulative_logprobs[i], reverse=True)[:n]

    def _tensors(self, output: RequestOutput, kept: list[int]) -> dict[str, np.ndarray]:
        def strings(values) -> np.ndarray:
            return np.array([values[i].encode("utf-8") for i in kept], dtype=np.object_)

        tensors = {"text_output": strings(self.texts)}
        wanted = self.request.returns
        if "finish_reason" in wanted:
            tensors["finish_reason"] = strings(self.finish_reasons)
        if "matched_stop" in wanted:
            tensors["matched_stop"] = strings([json.dumps(m) for m in self.matched_stops])
        if "cumulative_logprob" in wanted:
            tensors["cumulative_logprob"] = np.array([self.cumulative_logprobs[i] for i in kept], dtype=np.float32)
        if "logprobs" in wanted:  # null per choice when the request asked for no logprobs, as vllm_backend
            with_logprobs = self.request.params.logprobs is not None
            tensors["logprobs"] = strings([json.dumps(entries if with_logprobs else None) for entries in self.logprobs])
        if self.prompt_logprobs is not None:
            tensors["prompt_logprobs"] = np.array([json.dumps(self.prompt_logprobs).encode()], dtype=np.object_)
        if self.request.params.return_hidden_states:
            tensors["hidden_states"] = strings([json.dumps(rows) for rows in self.hidden_states])
        if self.request.params.return_routed_experts:
            tensors["routed_experts"] = strings([json.dumps(rows) for rows in self.routed_experts])
        if self.prompt_hidden_states is not None:
            tensors["prompt_hidden_states"] = np.array([json.dumps(self.prompt_hidden_states).encode()],
                                                       dtype=np.object_)
        tools = self.request.options.tools
        if tools is not None and tools.constrained:
            tensors["tool_calls"] = strings([json.dumps(calls) for calls in self.tool_calls])
        if self.reasoning is not None:
            tensors["reasoning_output"] = strings(self.reasoning)
            tensors["num_reasoning_tokens"] = np.array([self.num_reasoning_tokens[i] for i in kept], dtype=np.uint32)
        if "token_ids" in wanted:
            tensors["token_ids"] = strings([json.dumps(ids) for ids in self.token_ids])
        if "prompt_token_ids" in wanted and self.prompt_token_ids is not None:
            tensors["prompt_token_ids"] = np.array(self.prompt_token_ids, dtype=np.int32)
        if "num_input_tokens" in wanted:
            tensors["num_input_tokens"] = np.array([output.num_prompt_tokens], dtype=np.uint32)
        if "num_output_tokens" in wanted:  # the tokens this response carries, as vllm_backend counts them
            tensors["num_output_tokens"] = np.array([self.num_output_tokens[i] - self.num_reported_tokens[i]
                                                     for i in kept], dtype=np.uint32)
        if "num_cached_tokens" in wanted:
            tensors["num_cached_tokens"] = np.array([output.num_cached_tokens], dtype=np.uint32)
        if "cached_tokens_details" in wanted:
            tensors["cached_tokens_details"] = np.array(output.cached_by_tier, dtype=np.uint32)
        return tensors
