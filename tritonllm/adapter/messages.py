"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens) over the chat path.

A request becomes a chat completion request (`MessagesRequest.chat_request`), so its engine parameters, tool rules,
tool-call grammar and errors are the chat's own; the chat's answer becomes Anthropic's message (`anthropic_message`)
and its chunks Anthropic's stream events (`message_events`). Errors on these routes have Anthropic's shape
(errors.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tritonllm.adapter.errors import AdapterError, from_validation_error, internal_error, log_server_error
from tritonllm.adapter.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    TokenizeChatRequest,
    Usage,
)
from tritonllm.adapter.sse import resumed
from tritonllm.interface.tensors import FinishReason

logger = logging.getLogger(__name__)


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_control: dict[str, Any] | None = None
    """Anthropic's prompt-caching marker: the prefix cache here needs none."""


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(_Block):
    """An earlier answer's reasoning: the model's chat template drops it, as it drops an OpenAI message's."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """With type tool: the tool to call."""
    disable_parallel_tool_use: bool = False


class ThinkingConfig(BaseModel):
    """Anthropic's extended thinking: `disabled` renders the chat template with `enable_thinking: false` (a model
    that reasons in tags then answers at once); the budget is not enforced (max_tokens bounds the whole answer)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class _Conversation(BaseModel):
    """What both routes read: the conversation, its system prompt and tools."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request's fields for the conversation."""
        fields: dict[str, Any] = {"model": self.model, "messages": self._chat_messages()}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": tool.name, "parameters": tool.input_schema,
                **({"description": tool.description} if tool.description else {})}} for tool in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None and self.thinking.type == "disabled":
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        return fields

    def _chat_messages(self) -> list[dict[str, Any]]:
        """OpenAI's chat messages: tool results become tool messages (before the user's text, as Anthropic puts
        them first), an assistant's tool_use blocks its tool_calls."""
        chat: list[dict[str, Any]] = []
        if self.system:
            chat.append({"role": "system", "content": _text(self.system)})
        for message in self.messages:
            blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
                else message.content
            text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
            calls = [{"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input)}}
                     for block in blocks if isinstance(block, ToolUseBlock)]
            chat += [{"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)}
                     for block in blocks if isinstance(block, ToolResultBlock)]
            if message.role == "assistant" and calls:
                chat.append({"role": "assistant", "content": text or None, "tool_calls": calls})
            elif text or not any(isinstance(block, ToolResultBlock) for block in blocks):
                chat.append({"role": message.role, "content": text})
        return chat


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


class MessagesRequest(_Conversation):
    """Body of POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    """Anthropic's `user_id` for abuse monitoring: means nothing here."""
    service_tier: str | None = None
    """Anthropic's processing tier: means nothing here."""

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that runs this one (its engine parameters checked as the chat's)."""
        fields = self.chat_fields() | {"max_tokens": self.max_tokens, "stream": self.stream}
        sampling = {"stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k}
        fields |= {name: value for name, value in sampling.items() if value is not None}
        if self.stream:  # usage in every chunk: message_start carries the input tokens
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return _chat(fields, ChatCompletionRequest)


class CountTokensRequest(_Conversation):
    """Body of POST /v1/messages/count_tokens."""

    def tokenize_request(self) -> TokenizeChatRequest:
        fields = self.chat_fields()
        fields.pop("parallel_tool_calls", None)
        return _chat(fields, TokenizeChatRequest)


def _chat(fields: dict[str, Any], model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(fields)
    except ValidationError as error:
        raise from_validation_error(error) from None


class CountTokensResponse(BaseModel):
    input_tokens: int


class MessageUsage(BaseModel):
    """Anthropic's usage: input_tokens are the prompt's uncached tokens, cache_read_input_tokens the rest."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


def message_usage(usage: Usage) -> MessageUsage:
    cached = usage.prompt_tokens_details.cached_tokens
    return MessageUsage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                        cache_read_input_tokens=cached)


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    """Anthropic's message (a stream's message_start carries it empty)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    """text, thinking (a reasoning model's reasoning) and tool_use blocks."""
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error body of the Messages routes (errors.AdapterError.anthropic_body)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def _message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def stop_reason(finish_reason: str | None, matched_stop: str | int | None,
                stop_sequences: list[str] | None) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish."""
    if finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use", None
    if finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(matched_stop, str) and matched_stop in (stop_sequences or ()):
        return "stop_sequence", matched_stop
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its input; a call cut off by max_tokens has none that parse."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def anthropic_message(chat: ChatCompletionResponse, request: MessagesRequest) -> MessageResponse:
    [choice] = chat.choices
    message, content = choice.message, []
    if message.reasoning_content:
        content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        content.append({"type": "text", "text": message.content})
    content += [{"type": "tool_use", "id": call.id, "name": call.function.name,
                 "input": _tool_input(call.function.arguments)} for call in message.tool_calls or ()]
    reason, sequence = stop_reason(choice.finish_reason, choice.matched_stop, request.stop_sequences)
    return MessageResponse(id=_message_id(chat.id), model=chat.model, content=content, stop_reason=reason,
                           stop_sequence=sequence, usage=message_usage(chat.usage))


def _event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


async def message_events(first: ChatCompletionChunk, rest: AsyncGenerator[ChatCompletionChunk, None],
                         request: MessagesRequest) -> AsyncIterator[str]:
    """Anthropic's event sequence for a streamed chat whose first chunk is known: message_start, each content
    block's start, deltas and stop (thinking, text, tool_use), message_delta with the stop reason and usage,
    message_stop; a later failure is an error event."""
    blocks = _Blocks()
    usage = first.usage
    yield _event({"type": "message_start", "message": MessageResponse(
        id=_message_id(first.id), model=first.model, content=[], stop_reason=None, stop_sequence=None,
        usage=message_usage(usage).model_copy(update={"output_tokens": 0})).model_dump()})
    finish: tuple[str | None, str | int | None] = (None, None)
    try:
        async with aclosing(resumed(first, rest)) as chunks:
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    for event in blocks.events(choice.delta):
                        yield event
                    if choice.finish_reason is not None:
                        finish = (choice.finish_reason, choice.matched_stop)
    except AdapterError as error:
        log_server_error(error)
        yield _event(error.anthropic_body())
        return
    except Exception:
        logger.exception("unexpected error while streaming a message")
        yield _event(internal_error().anthropic_body())
        return
    for event in blocks.close():
        yield event
    reason, sequence = stop_reason(*finish, request.stop_sequences)
    yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                  "usage": {"output_tokens": usage.completion_tokens}})
    yield _event({"type": "message_stop"})


class _Blocks:
    """The stream's content blocks: a delta of another kind (thinking, text, a new tool call) closes the open
    block and starts the next."""

    def __init__(self) -> None:
        self._open: tuple[str, int] | None = None  # (kind, tool call index) of the open block
        self._index = -1

    def events(self, delta) -> list[str]:
        events = []
        if delta.reasoning_content:
            events += self._start(("thinking", -1), {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            events += self._start(("text", -1), {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or ():
            if call.id is not None:
                events += self._start(("tool_use", call.index), {"type": "tool_use", "id": call.id,
                                                                 "name": call.function["name"], "input": {}})
            if call.function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.function["arguments"]}))
        return events

    def close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_event({"type": "content_block_stop", "index": self._index})]

    def _start(self, kind: tuple[str, int], block: dict[str, Any]) -> list[str]:
        if self._open == kind:
            return []
        events = self.close()
        self._open, self._index = kind, self._index + 1
        return events + [_event({"type": "content_block_start", "index": self._index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event({"type": "content_block_delta", "index": self._index, "delta": delta})
