"""Turns a prompt and its parameters into a `CoreRequest` for the engine core, off the core's thread:
tokenization or the model's chat template, the checks that need the model (context length, vocabulary, what the
model supports), the LoRA adapter's files, and the start of the constraint's grammar compile.

Owned by one thread (Triton's execute(), or LLMEngine's caller); it has its own tokenizer."""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from llguidance import LLMatcher
from transformers import AutoTokenizer

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.engine_core import ModelLimits
from tritonllm.engine.core.sequence import CoreRequest
from tritonllm.engine.core.structured_output import allowed_tokens_bitmask
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.parameters import SamplingParams
from tritonllm.interface.tools import NO_PARAMETERS, ToolSpec
from tritonllm.engine.layers.lora import LoraAdapter
from tritonllm.engine.processing.grammar_compiler import GrammarCompiler
from tritonllm.engine.processing.lora_files import AdapterDirectory
from tritonllm.engine.processing.reasoning import ReasoningStart, reasoning_start, reasoning_tags
from tritonllm.engine.processing.tool_calls import HERMES_TEMPLATE, tool_call_lark


@dataclass(frozen=True)
class PromptOptions:
    """How a prompt becomes token ids (vLLM's names and defaults)."""

    add_special_tokens: bool | None = None
    """None: true for a text prompt (BOS where the model has one), false for chat messages (their template adds
    what the model needs)."""
    add_generation_prompt: bool = True
    """Chat: end the rendered conversation with the assistant's turn opened."""
    continue_final_message: bool = False
    """Chat: leave the final message open (no end-of-turn), for the model to continue it."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Chat: extra variables for the template (e.g. a model's `enable_thinking`)."""
    tools: ToolSpec | None = None
    """Chat: the tools the template shows the model, and how it may call them (the call grammar)."""


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt as the engine sees it (Triton's tokenize_only answer)."""

    token_ids: list[int]
    token_strs: list[str]  # the tokenizer's own string of each token (e.g. "Ġthe")
    text: str  # the text prompt itself, else the decoded token ids (a chat: its rendered template)


def load_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: Path, tokenizer) -> set[int]:
    """EOS ids from the generation config, the model config and the tokenizer."""
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class InputProcessor:
    def __init__(self, config: EngineConfig, limits: ModelLimits, tokenizer, grammars: GrammarCompiler):
        self.config = config
        self.limits = limits
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.adapters = AdapterDirectory(config.lora_dir, limits.arch, config.max_lora_rank) if config.lora_dir \
            else None
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # recently used adapters, read once
        self._own_template_renders_tools: bool | None = None  # found out on the first request with tools
        self.reasoning_tags = reasoning_tags(config.reasoning_parser, tokenizer.chat_template)

    def process(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams,
                options: PromptOptions = PromptOptions()) -> CoreRequest:
        """Raises InvalidRequest (or NotFound, for an unknown adapter) naming what is wrong."""
        if params.priority != 0 and self.config.scheduling_policy != "priority":  # as vLLM: not silently ignored
            raise InvalidRequest(f"priority {params.priority} needs priority scheduling, and this server schedules "
                                 f"first come, first served (--scheduling-policy {self.config.scheduling_policy})",
                                 "priority")
        if params.use_beam_search and params.num_sequences > self.config.max_num_seqs:  # (its beams step together)
            raise InvalidRequest(f"beam search over {params.num_sequences} beams needs as many sequences in the "
                                 f"running batch; this server runs at most {self.config.max_num_seqs} "
                                 "(--max-num-seqs)", "best_of" if params.best_of else "n")
        prompt_token_ids, rendered = self._tokenize(prompt, options)
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        prompt_len, capacity = len(prompt_token_ids), self.limits.capacity
        if prompt_len >= capacity:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; this model accepts at most {capacity - 1}")
        max_tokens = capacity - prompt_len if params.max_tokens is None else params.max_tokens
        if prompt_len + max_tokens > capacity:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"of {capacity} tokens", "max_tokens")
        self._check_token_ids(params)
        self._check_extensions(params, prompt_len, max_tokens)
        lora = self._adapter(params.lora_path)
        answer_start = None if rendered is None else self._reasoning_start(prompt, options, rendered)
        constraint = self._tool_constraint(options.tools, params) or params.constraint
        grammar = None if constraint is None else self.grammars.compile(
            *constraint, None if answer_start is None else (self.reasoning_tags, answer_start))
        allowed = allowed_tokens_bitmask(params.allowed_token_ids, self.limits.vocab_size) \
            if params.allowed_token_ids else None
        return CoreRequest(request_id, prompt_token_ids, params, max_tokens, lora, grammar, allowed, answer_start)

    def tokenize(self, prompt: str | list[int] | list[dict], options: PromptOptions,
                 lora_path: str | None = None) -> TokenizedPrompt:
        """The prompt's tokens, nothing generated (an empty prompt has none). An adapter named is read and
        checked as a generation would (then kept among the recent ones): runtime LoRA loads ask so."""
        self._adapter(lora_path)
        token_ids, _ = self._tokenize(prompt, options)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(token_ids)
        return TokenizedPrompt(token_ids, self.tokenizer.convert_ids_to_tokens(token_ids), text)

    def _tokenize(self, prompt: str | list[int] | list[dict], options: PromptOptions) -> tuple[list[int], str | None]:
        """Token ids of a text, token-id or chat-messages prompt, and a chat's rendered template."""
        if prompt and isinstance(prompt[0], dict):
            rendered = self._render_chat(prompt, options)
            # The rendered template carries its own special tokens (BOS included where the model has one).
            return self.tokenizer.encode(rendered, add_special_tokens=bool(options.add_special_tokens)), rendered
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=options.add_special_tokens is not False), None
        token_ids = [int(t) for t in prompt]
        bad = [t for t in token_ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.limits.vocab_size})")
        return token_ids, None

    def _reasoning_start(self, messages: list[dict], options: PromptOptions, rendered: str) -> ReasoningStart | None:
        """Where a chat's output starts against the model's reasoning (None: nothing to parse): read off what the
        template put after the last message's content (with that content when it is continued), so a tag that an
        earlier message or the final one holds does not count unless the model continues it."""
        if self.reasoning_tags is None:
            return None
        content = messages[-1].get("content")
        at = rendered.rfind(content) if isinstance(content, str) and content else -1
        end = rendered if at < 0 else rendered[at if options.continue_final_message else at + len(content):]
        return reasoning_start(self.reasoning_tags, end)

    def _render_chat(self, messages: list[dict], options: PromptOptions) -> str:
        """The model's own chat template applied to the messages."""
        if not self.tokenizer.chat_template:
            raise InvalidRequest(f"the model {self.limits.name} has no chat template: send text_input or "
                                 "input_ids instead of messages")
        reserved = sorted(set(options.chat_template_kwargs) & self._rendering_arguments())
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}: they are the renderer's "
                                 "own arguments", "chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tokenize=False,
                **self._template_arguments(messages, options.tools), **options.chat_template_kwargs)
        except Exception as error:  # templates may raise on their own, e.g. on an unexpected role order
            raise InvalidRequest(f"the chat template rejected the messages: {error}") from None

    def _template_arguments(self, messages: list[dict], tools: ToolSpec | None) -> dict:
        """The tools for the template, and the shipped Hermes template in place of the model's own when that
        renders no tools (and the conversation has tools, calls or their results)."""
        arguments = {} if tools is None else {"tools": tools.tools}
        with_tools = tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if with_tools and not self._renders_tools():
            arguments["chat_template"] = HERMES_TEMPLATE
        return arguments

    def _renders_tools(self) -> bool:
        """Whether the model's own chat template renders tools: a probe tool's name shows in its rendering."""
        if self._own_template_renders_tools is None:
            probe = [{"type": "function", "function": {"name": "tritonllm_probe_tool", "parameters": NO_PARAMETERS}}]
            try:
                self._own_template_renders_tools = "tritonllm_probe_tool" in self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}], tools=probe, tokenize=False)
            except Exception:  # a template that fails on the probe cannot render tools either
                self._own_template_renders_tools = False
        return self._own_template_renders_tools

    def _tool_constraint(self, tools: ToolSpec | None, params: SamplingParams) -> tuple[str, str] | None:
        """The tool-call grammar of a request whose tool_choice lets the model call tools (each function's
        parameters schema checked on its own first, so an error names the tool)."""
        if tools is None or not tools.constrained:
            return None
        if params.use_beam_search:  # (beams are ranked on the raw logprobs: no grammar applies to them)
            raise InvalidRequest("use_beam_search cannot be combined with tools: their calls are constrained "
                                 "(set tool_choice to none)", "use_beam_search")
        if params.constraint is not None:
            raise InvalidRequest(f"tool_choice {tools.choice!r} constrains the answer to tool calls: it cannot be "
                                 f"combined with {params.constraint[0]} (set tool_choice to none)", "tool_choice")
        for index, tool in enumerate(tools.tools):
            schema = tool["function"].get("parameters") or NO_PARAMETERS
            try:
                is_error, messages = LLMatcher.validate_grammar_with_warnings(
                    LLMatcher.grammar_from_json_schema(schema))
                error = messages[0] if is_error else None
            except ValueError as exc:
                error = str(exc)
            if error:
                raise InvalidRequest(f"tools[{index}].function.parameters is not a usable JSON schema: {error}",
                                     "tools")
        return "tools", tool_call_lark(tools)

    def _rendering_arguments(self) -> set[str]:
        """apply_chat_template's own parameters: chat_template_kwargs must not override them (e.g. tokenize)."""
        parameters = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        return {parameter.name for parameter in parameters if parameter.kind is not parameter.VAR_KEYWORD}

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.limits.vocab_size
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                                ("allowed_token_ids", params.allowed_token_ids)):
            bad = [t for t in token_ids if t >= vocab]
            if bad:
                raise InvalidRequest(f"{name} has token id {bad[0]}, outside the vocabulary [0, {vocab})", name)

    def _check_extensions(self, params: SamplingParams, prompt_len: int, max_tokens: int) -> None:
        if params.return_routed_experts and not self.limits.is_moe:
            raise InvalidRequest(f"the model {self.limits.name} has no experts (dense Llama): "
                                 "return_routed_experts needs a mixture-of-experts model", "return_routed_experts")
        if params.return_hidden_states or params.return_prompt_hidden_states:
            per_choice = (max_tokens if params.return_hidden_states else 0) + \
                (prompt_len if params.return_prompt_hidden_states else 0)
            rows = per_choice * params.num_sequences
            if rows > self.config.max_hidden_states_tokens:
                raise InvalidRequest(
                    f"return_hidden_states would return {rows} hidden states (choices × (max_tokens + echoed prompt "
                    f"tokens)); this server's max_hidden_states_tokens is {self.config.max_hidden_states_tokens}: "
                    "lower max_tokens or n", "return_hidden_states")

    def _adapter(self, lora_path: str | None) -> LoraAdapter | None:
        """The request's LoRA adapter, read from its files on first use (then kept among the recent ones)."""
        if lora_path is None:
            return None
        if self.adapters is None:
            raise InvalidRequest("LoRA adapters are not enabled on this server (no lora_dir)", "lora_path")
        name = self.adapters.resolve(lora_path)
        adapter = self._loaded.pop(name, None) or self.adapters.load(name)
        self._loaded[name] = adapter
        while len(self._loaded) > self.config.max_loras:
            self._loaded.popitem(last=False)
        return adapter
