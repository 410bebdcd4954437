"""The chat adapter without Triton: request validation, and completion chunks reshaped into chat chunks."""

from __future__ import annotations

import json

import pytest

from tritonllm.adapter.chat import ChatService
from tritonllm.adapter.completions import sampling_parameters
from tritonllm.adapter.errors import AdapterError
from tritonllm.adapter.protocol import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    parse_request,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def _parse(**fields) -> ChatCompletionRequest:
    return parse_request(json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode(), ChatCompletionRequest)


def _error(body: str) -> AdapterError:
    with pytest.raises(AdapterError) as caught:
        parse_request(body.encode(), ChatCompletionRequest)
    return caught.value


def test_defaults_and_sampling_parameters():
    request = _parse()
    assert request.prompts() == [MESSAGES]
    assert request.max_tokens is None and request.engine_logprobs() is None
    # vLLM's and OpenAI's chat default: no max_tokens is up to the end of the context (the engine's default is 16)
    assert sampling_parameters(request) == {"max_tokens": None}


def test_max_completion_tokens_and_logprobs():
    request = _parse(max_tokens=9, max_completion_tokens=3, logprobs=True, top_logprobs=2)
    assert sampling_parameters(request)["max_tokens"] == 3
    assert sampling_parameters(request)["logprobs"] == 2
    assert _parse(logprobs=True).engine_logprobs() == 0


@pytest.mark.parametrize("messages", ['[]', '"hi"', '[{"role": "x", "content": "a"}]', '[{"role": "user"}]',
                                      '[{"role": "user", "content": ["a"]}]'])
def test_bad_messages_name_messages(messages):
    error = _error(f'{{"model": "m", "messages": {messages}}}')
    assert error.status_code == 400 and error.param == "messages"


def test_top_logprobs_needs_logprobs():
    error = _error('{"model": "m", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}')
    assert error.param == "top_logprobs"


class _FakeCompletions:
    def __init__(self, chunks: list[CompletionResponse]) -> None:
        self._chunks = chunks

    async def stream(self, request):
        for chunk in self._chunks:
            yield chunk


def _chunk(*choices: CompletionChoice) -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", created=1, model="m", choices=list(choices))


async def test_stream_puts_role_in_each_choice_first_chunk_only():
    logprobs = CompletionLogprobs(tokens=["é"], token_logprobs=[-0.5], top_logprobs=[{"é": -0.5, "e": -1.0}],
                                  text_offset=[0])
    chunks = [
        _chunk(CompletionChoice(index=0, text="Hel", logprobs=logprobs)),
        _chunk(CompletionChoice(index=0, text="lo"), CompletionChoice(index=1, text="Hi", finish_reason="stop")),
        _chunk(CompletionChoice(index=0, text="", finish_reason="length")),
    ]
    service = ChatService(_FakeCompletions(chunks))
    out = [chunk async for chunk in service.stream(_parse())]
    assert [chunk.id for chunk in out] == ["chatcmpl-1"] * 3
    assert all(chunk.object == "chat.completion.chunk" for chunk in out)
    deltas = [[(c.index, c.delta.model_dump(), c.finish_reason) for c in chunk.choices] for chunk in out]
    assert deltas == [
        [(0, {"role": "assistant", "content": "Hel"}, None)],
        [(0, {"content": "lo"}, None), (1, {"role": "assistant", "content": "Hi"}, "stop")],
        [(0, {"content": ""}, "length")],
    ]
    [entry] = out[0].choices[0].logprobs.content
    assert entry.bytes == list("é".encode()) and [top.token for top in entry.top_logprobs] == ["é", "e"]
