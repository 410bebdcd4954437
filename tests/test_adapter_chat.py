"""The chat adapter without Triton: request validation, and completion chunks reshaped into chat chunks."""

from __future__ import annotations

import json

import pytest

from test_adapter_completions import ScriptedTriton
from tritonllm.adapter.chat import ChatService
from tritonllm.adapter.completions import CompletionService, sampling_parameters
from tritonllm.adapter.errors import AdapterError
from tritonllm.adapter.protocol import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    parse_request,
)
from tritonllm.adapter.triton_client import ChoiceOutput, TritonChunk

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


def _reasoning_script() -> ScriptedTriton:
    """A reasoning model's chat as the engine sends it: reasoning, then the answer; the reasoning token count a
    running total."""
    return ScriptedTriton({str(MESSAGES): [
        TritonChunk([ChoiceOutput("", None, [], 2, None, reasoning="Let me", num_reasoning_tokens=2)], 5, 0, None),
        TritonChunk([ChoiceOutput("", None, [], 2, None, reasoning=" see.", num_reasoning_tokens=4)], 5, 0, None),
        TritonChunk([ChoiceOutput("Paris", "stop", [], 1, None, reasoning="", num_reasoning_tokens=4)], 5, 0, None),
    ]})


async def test_reasoning_goes_to_reasoning_content_and_usage_counts_its_tokens():
    chat = ChatService(CompletionService(_reasoning_script(), "m"))
    whole = (await chat.complete(_parse())).model_dump()
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "Paris")
    assert whole["usage"]["completion_tokens"] == 5
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    chunks = [chunk.model_dump() async for chunk in chat.stream(_parse(stream=True,
                                                                       stream_options={"include_usage": True}))]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas == [{"role": "assistant", "content": None, "reasoning_content": "Let me"},
                      {"content": None, "reasoning_content": " see."}, {"content": "Paris"}]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


async def test_a_model_without_reasoning_has_no_reasoning_fields():
    triton = ScriptedTriton({str(MESSAGES): [TritonChunk([ChoiceOutput("Hi", "stop", [], 1, None)], 5, 0, None)]})
    whole = (await ChatService(CompletionService(triton, "m")).complete(_parse())).model_dump()
    assert "reasoning_content" not in whole["choices"][0]["message"]
    assert "completion_tokens_details" not in whole["usage"]
