"""OpenAI's Responses API (POST /v1/responses), stateless, over the chat path.

A request becomes a chat completion request (`ResponsesRequest.chat_request`), so its engine parameters, tool
rules, tool-call grammar, structured output and errors are the chat's own. The answer becomes output items
(reasoning, message, function_call) through one builder, `_OutputItems`, which the whole response and the stream's
events (`response_events`) share. Nothing is stored: `store: true` and `previous_response_id` are refused with a
400 saying so (send the conversation's items in `input`)."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tritonllm.adapter.errors import AdapterError, from_validation_error, internal_error, invalid_request, \
    log_server_error
from tritonllm.adapter.protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, Usage
from tritonllm.adapter.sse import resumed
from tritonllm.interface.tensors import FinishReason

logger = logging.getLogger(__name__)


class FunctionTool(BaseModel):
    """A function tool (the only kind this server runs)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted: the arguments always follow the schema (constrained decoding)."""


class TextFormat(BaseModel):
    """`text.format`: text, json_object, or json_schema {name, schema, strict, description}."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = None
    """Accepted, means nothing here."""


class ResponsesRequest(BaseModel):
    """Body of POST /v1/responses."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    """A user message, or items: messages, function_call, function_call_output (reasoning items are dropped, as a
    chat template drops an earlier answer's reasoning)."""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    """Nothing is stored: only false (or left out) is accepted."""
    previous_response_id: str | None = None
    """Refused: nothing is stored to continue from."""
    # accepted and meaningless here, as IgnoredParameters of the chat API
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    """{effort, summary}: effort "none" renders the chat template with `enable_thinking: false` (a model that reasons
    in tags then answers at once); any other reasons as the template says."""

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that runs this one; a 400 for what this server does not keep."""
        if self.previous_response_id is not None:
            raise invalid_request("previous_response_id is not supported: this server stores no responses; send "
                                  "the conversation's items in input.", "previous_response_id")
        if self.store:
            raise invalid_request("store is not supported: this server stores no responses; set store to false.",
                                  "store")
        fields: dict[str, Any] = {"model": self.model, "messages": self._chat_messages(), "stream": self.stream,
                                  "max_tokens": self.max_output_tokens}
        sampling = {"temperature": self.temperature, "top_p": self.top_p,
                    "parallel_tool_calls": self.parallel_tool_calls}
        fields |= {name: value for name, value in sampling.items() if value is not None}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(
                include={"name", "description", "parameters"}, exclude_none=True)} for tool in self.tools]
        if isinstance(self.tool_choice, dict):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.get("name")}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict}}
        elif text_format is not None and text_format.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        if (self.reasoning or {}).get("effort") == "none":
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        if self.stream:  # the usage comes with the last chunk
            fields["stream_options"] = {"include_usage": True}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as error:
            raise from_validation_error(error) from None

    def _chat_messages(self) -> list[dict[str, Any]]:
        chat: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for index, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                role = {"developer": "system"}.get(item.get("role"), item.get("role"))
                chat.append({"role": role, "content": _item_text(item.get("content"), index)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
                if chat and chat[-1]["role"] == "assistant":  # one answer's calls (and text) are one message
                    chat[-1].setdefault("tool_calls", []).append(call)
                else:
                    chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                chat.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _item_text(output, index)})
            elif kind != "reasoning":
                raise invalid_request(f"input[{index}] has type {kind!r}; this server takes message, function_call, "
                                      "function_call_output and reasoning items.", "input")
        return chat


def _item_text(content: Any, index: int) -> Any:
    """A message item's content as chat text: a string, or its input_text / output_text parts' texts (anything
    else is left for the chat's own checks to refuse)."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
               and isinstance(part.get("text"), str) for part in content):
        raise invalid_request(f"input[{index}].content: only input_text and output_text parts are supported (this "
                              "model reads text only).", "input")
    return "".join(part["text"] for part in content)


class ResponseObject(BaseModel):
    """OpenAI's response (the stream's lifecycle events carry it too)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    """reasoning, message and function_call items."""
    incomplete_details: dict[str, str] | None = None
    error: None = None
    instructions: str | None = None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any]
    metadata: dict[str, str]
    previous_response_id: None = None
    store: bool = False
    usage: dict[str, Any] | None = None


def _response(request: ResponsesRequest, response_id: str, created_at: int, model: str, output: list[dict],
              finish_reason: str | None, usage: Usage | None) -> ResponseObject:
    """The response as it stands: in progress until a finish reason is known."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == FinishReason.LENGTH else "completed"
    return ResponseObject(
        id=response_id, created_at=created_at, status=status, model=model, output=output,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        instructions=request.instructions,
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        tool_choice=request.tool_choice or "auto",
        parallel_tool_calls=request.parallel_tool_calls is not False,
        temperature=request.temperature, top_p=request.top_p, max_output_tokens=request.max_output_tokens,
        text=request.text.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format
        else {"format": {"type": "text"}},
        metadata=request.metadata or {},
        usage=None if usage is None else _usage(usage),
    )


def _usage(usage: Usage) -> dict[str, Any]:
    details = usage.completion_tokens_details
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details else 0},
            "total_tokens": usage.total_tokens}


def _response_id(chat_id: str) -> str:
    return "resp_" + chat_id.removeprefix("chatcmpl-")


class _OutputItems:
    """Output items built from a chat answer's pieces (reasoning, text, tool-call deltas), with the stream events
    each piece makes: a piece of another kind closes the open item and adds the next."""

    _ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}  # OpenAI's

    def __init__(self, response_id: str) -> None:
        self._id_base = response_id.removeprefix("resp_")
        self.items: list[dict[str, Any]] = []
        self._open: tuple[str, int] | None = None  # (kind, tool call index) of the last item while it grows

    def add(self, reasoning: str | None, text: str | None, calls: list[dict]) -> list[tuple[str, dict]]:
        events = []
        if reasoning:
            events += self._start(("reasoning", -1), {"type": "reasoning", "summary": [],
                                                      "content": [{"type": "reasoning_text", "text": ""}]})
            self.items[-1]["content"][0]["text"] += reasoning
            events.append(("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": reasoning}))
        if text:
            events += self._start(("message", -1), {"type": "message", "role": "assistant", "content": []})
            if not self.items[-1]["content"]:
                part = {"type": "output_text", "text": "", "annotations": []}
                self.items[-1]["content"].append(part)
                events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": part}))
            self.items[-1]["content"][0]["text"] += text
            events.append(("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                          "logprobs": []}))
        for call in calls:
            if call.get("id") is not None:
                events += self._start(("function_call", call["index"]), {
                    "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                    "arguments": ""})
            arguments = call["function"].get("arguments")
            if arguments:
                self.items[-1]["arguments"] += arguments
                events.append(("response.function_call_arguments.delta", {**self._where(), "delta": arguments}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        """The open item's done events."""
        if self._open is None:
            return []
        self._open, item, where = None, self.items[-1], self._where()
        item["status"] = "completed"
        events = []
        if item["type"] == "reasoning":
            events.append(("response.reasoning_text.done", {**where, "content_index": 0,
                                                            "text": item["content"][0]["text"]}))
        elif item["type"] == "message":
            part = item["content"][0]
            events += [("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                      "logprobs": []}),
                       ("response.content_part.done", {**where, "content_index": 0, "part": part})]
        else:
            events.append(("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                      "arguments": item["arguments"]}))
        return events + [("response.output_item.done", {"output_index": len(self.items) - 1, "item": item})]

    def _start(self, kind: tuple[str, int], item: dict[str, Any]) -> list[tuple[str, dict]]:
        if self._open == kind:
            return []
        events = self.close()
        self._open = kind
        item_id = f"{self._ID_PREFIXES[item['type']]}_{self._id_base}{len(self.items)}"
        self.items.append({"id": item_id, **item, "status": "in_progress"})
        return events + [("response.output_item.added", {"output_index": len(self.items) - 1,
                                                         "item": json.loads(json.dumps(self.items[-1]))})]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}


def whole_response(chat: ChatCompletionResponse, request: ResponsesRequest) -> ResponseObject:
    [choice] = chat.choices
    message, response_id = choice.message, _response_id(chat.id)
    output = _OutputItems(response_id)
    calls = [{"index": index, "id": call.id, "function": {"name": call.function.name,
                                                          "arguments": call.function.arguments}}
             for index, call in enumerate(message.tool_calls or ())]
    output.add(message.reasoning_content, message.content, calls)
    output.close()
    return _response(request, response_id, chat.created, chat.model, output.items, choice.finish_reason, chat.usage)


async def response_events(first: ChatCompletionChunk, rest: AsyncGenerator[ChatCompletionChunk, None],
                          request: ResponsesRequest) -> AsyncIterator[str]:
    """The Responses event sequence of a streamed chat whose first chunk is known: response.created and
    .in_progress, each item's added / deltas / done, then response.completed (or .incomplete); a later failure
    is an error event."""
    sequence = itertools.count()
    response_id, created_at, model = _response_id(first.id), int(time.time()), first.model

    def event(kind: str, payload: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": next(sequence), **payload}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    started = _response(request, response_id, created_at, model, [], None, None).model_dump()
    yield event("response.created", {"response": started})
    yield event("response.in_progress", {"response": started})
    output, finish_reason, usage = _OutputItems(response_id), None, None
    try:
        async with aclosing(resumed(first, rest)) as chunks:
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    calls = [call.model_dump() for call in choice.delta.tool_calls or ()]
                    for kind, payload in output.add(choice.delta.reasoning_content, choice.delta.content, calls):
                        yield event(kind, payload)
                    finish_reason = choice.finish_reason or finish_reason
    except Exception as error:
        if not isinstance(error, AdapterError):
            logger.exception("unexpected error while streaming a response")
        error = error if isinstance(error, AdapterError) else internal_error()
        log_server_error(error)
        yield event("error", {"code": error.code or error.type, "message": error.message, "param": error.param})
        return
    for kind, payload in output.close():
        yield event(kind, payload)
    final = _response(request, response_id, created_at, model, output.items, finish_reason or FinishReason.STOP, usage)
    yield event(f"response.{final.status}", {"response": final.model_dump()})
