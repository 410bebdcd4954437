"""Chat completions: the completion service runs the conversation (the engine applies the chat template), and
its responses and chunks are reshaped into OpenAI's chat objects here."""

from collections.abc import AsyncIterator

from tritonllm.adapter.completions import CompletionService
from tritonllm.adapter.logprobs import chat_logprobs
from tritonllm.adapter.protocol import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ToolCall,
    ToolCallDelta,
)


def _chat_id(completion_id: str) -> str:
    # "cmpl-…" becomes OpenAI's "chatcmpl-…": the same request, recognisable in Triton's request ids.
    return "chat" + completion_id


class ChatService:
    """Runs chat completion requests through the completion service."""

    def __init__(self, completions: CompletionService) -> None:
        self._completions = completions

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        completion = await self._completions.complete(request)
        return ChatCompletionResponse(
            id=_chat_id(completion.id),
            created=completion.created,
            model=completion.model,
            choices=[
                ChatCompletionChoice(
                    index=choice.index,
                    message=_message(choice, request),
                    logprobs=chat_logprobs(choice.logprobs, request.engine_logprobs()) if choice.logprobs else None,
                    finish_reason=choice.finish_reason,
                    matched_stop=choice.matched_stop,
                    hidden_states=choice.hidden_states,
                    token_ids=choice.token_ids,
                )
                for choice in completion.choices
            ],
            usage=completion.usage,
            sglext=completion.sglext,
            prompt_token_ids=completion.choices[0].prompt_token_ids,  # (one prompt: the conversation)
        )

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Chat chunks; each choice's first one carries the assistant role, and one its finish reason."""
        started: set[int] = set()
        async for chunk in self._completions.stream(request):
            yield _chat_chunk(chunk, started, request)


def _message(choice: CompletionChoice, request: ChatCompletionRequest) -> AssistantMessage:
    """OpenAI's answer: content null when the answer is tool calls only."""
    if not choice.tool_calls:
        return AssistantMessage(role=request.response_role(), content=choice.text,
                                reasoning_content=choice.reasoning_content)
    return AssistantMessage(role=request.response_role(), content=choice.text or None,
                            reasoning_content=choice.reasoning_content,
                            tool_calls=[ToolCall.model_validate(call) for call in choice.tool_calls])


def _chat_chunk(chunk: CompletionResponse, started: set[int], request: ChatCompletionRequest) -> ChatCompletionChunk:
    """One completion chunk as a chat chunk; `started` holds the choices that have had their first chunk."""
    # vLLM's shape: the conversation's token ids once, in the stream's first chunk
    prompt_token_ids = next((choice.prompt_token_ids for choice in chunk.choices), None) if not started else None
    choices = []
    for choice in chunk.choices:
        first = choice.index not in started
        started.add(choice.index)
        choices.append(
            ChatChunkChoice(
                index=choice.index,
                # SGLang streams hidden states in the delta (of a chunk of their own)
                delta=ChatDelta(role=request.response_role() if first else None,
                                content=None if (choice.tool_calls or choice.reasoning_content) and not choice.text
                                else choice.text, reasoning_content=choice.reasoning_content,
                                tool_calls=[ToolCallDelta.model_validate(delta) for delta in choice.tool_calls or ()]
                                or None, hidden_states=choice.hidden_states),
                logprobs=chat_logprobs(choice.logprobs, request.engine_logprobs()) if choice.logprobs else None,
                finish_reason=choice.finish_reason,
                matched_stop=choice.matched_stop,
                token_ids=choice.token_ids,
            )
        )
    return ChatCompletionChunk(
        id=_chat_id(chunk.id), created=chunk.created, model=chunk.model, choices=choices, usage=chunk.usage,
        sglext=chunk.sglext, prompt_token_ids=prompt_token_ids,
    )
