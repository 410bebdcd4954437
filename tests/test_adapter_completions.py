"""Completion assembly, SSE framing, logprobs and cancellation, against a scripted stand-in for Triton."""

import asyncio
import json

import pytest

from openai_adapter.completions import CompletionService, sampling_parameters
from openai_adapter.concurrency import merge
from openai_adapter.errors import AdapterError, invalid_request
from openai_adapter.logprobs import LogprobsAccumulator, completion_logprobs
from openai_adapter.protocol import CompletionRequest, CompletionResponse
from openai_adapter.sse import DONE_EVENT, chunk_event, completion_events
from openai_adapter.triton_client import ChoiceOutput, TritonChunk

MODEL = "test-model"


def _request(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi", **fields})


def _chunk(*choices: tuple, prompt_tokens: int = 2) -> TritonChunk:
    """A response whose choices are (text, finish_reason, num_output_tokens[, logprob entries])."""
    return TritonChunk(
        choices=[
            ChoiceOutput(text, finish, list(rest[0]) if rest else [], tokens) for text, finish, tokens, *rest in choices
        ],
        num_input_tokens=prompt_tokens,
        num_cached_tokens=1,
    )


class ScriptedTriton:
    """Plays back a list of responses (or an exception) per prompt; remembers which streams were closed."""

    def __init__(self, scripts: dict, hang_after_script: bool = False) -> None:
        self.scripts = scripts
        self.hang_after_script = hang_after_script
        self.calls: list[dict] = []
        self.closed: list = []

    async def generate(self, prompt, sampling_parameters, *, stream, return_logprobs, request_id):
        self.calls.append({"prompt": prompt, "parameters": sampling_parameters, "stream": stream})
        try:
            for item in self.scripts[str(prompt)]:
                await asyncio.sleep(0)
                if isinstance(item, Exception):
                    raise item
                yield item
            if self.hang_after_script:
                await asyncio.Event().wait()
        finally:
            self.closed.append(prompt)


async def _collect(iterator) -> list:
    return [item async for item in iterator]


def test_sampling_parameters_carry_only_what_the_engine_needs():
    parameters = sampling_parameters(_request(max_tokens=None, stop="\n", seed=0, top_k=5))
    assert parameters == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 5,
        "min_p": 0.0,
        "n": 1,
        "ignore_eos": False,
        "min_tokens": 0,
        "skip_special_tokens": True,
        "seed": 0,
        "stop": ["\n"],
    }
    assert sampling_parameters(_request(max_tokens=0, logprobs=0, stop_token_ids=[7]))["max_tokens"] == 0
    assert sampling_parameters(_request(logprobs=0))["logprobs"] == 0
    assert "logprobs" not in sampling_parameters(_request())


def test_logprobs_offsets_run_across_pieces():
    entries = [
        {"token": "Hel", "token_id": 1, "logprob": -0.1, "top": {"Hel": -0.1, "He": -2.0}},
        {"token": "lo", "token_id": 2, "logprob": -0.2, "top": {"lo": -0.2}},
    ]
    logprobs, end = completion_logprobs(entries, start_offset=3)
    assert logprobs.tokens == ["Hel", "lo"]
    assert logprobs.token_logprobs == [-0.1, -0.2]
    assert logprobs.top_logprobs == [{"Hel": -0.1, "He": -2.0}, {"lo": -0.2}]
    assert logprobs.text_offset == [3, 6]
    assert end == 8

    accumulator = LogprobsAccumulator(start_offset=0)
    assert accumulator.add(entries[:1]).text_offset == [0]
    assert accumulator.add(entries[1:]).text_offset == [3]
    assert accumulator.total.text_offset == [0, 3]
    assert accumulator.total.tokens == ["Hel", "lo"]


async def test_batch_with_n_is_prompt_major_and_sums_usage():
    triton = ScriptedTriton(
        {
            "a": [_chunk((" a0", "stop", 1), (" a1", "length", 2), prompt_tokens=3)],
            "b": [_chunk((" b0", "length", 4), (" b1", "stop", 5), prompt_tokens=4)],
        }
    )
    response = await CompletionService(triton, MODEL).complete(_request(prompt=["a", "b"], n=2))
    assert [(choice.index, choice.text, choice.finish_reason) for choice in response.choices] == [
        (0, " a0", "stop"),
        (1, " a1", "length"),
        (2, " b0", "length"),
        (3, " b1", "stop"),
    ]
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.usage.model_dump() == {
        "prompt_tokens": 7,
        "completion_tokens": 12,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert [call["stream"] for call in triton.calls] == [False, False]


async def test_non_streamed_echo_and_logprobs_accumulate():
    entry = {"token": " x", "token_id": 9, "logprob": -1.0, "top": {" x": -1.0}}
    triton = ScriptedTriton({"Hi": [_chunk((" x x", "length", 2, [entry, entry]))]})
    service = CompletionService(triton, MODEL)
    echoed = await service.complete(_request(echo=True))
    assert echoed.choices[0].text == "Hi x x"
    with_logprobs = await service.complete(_request(logprobs=1))
    assert with_logprobs.choices[0].logprobs.text_offset == [0, 2]


async def test_stream_gives_each_choice_one_finish_chunk_and_usage_last():
    triton = ScriptedTriton(
        {
            "Hi": [
                _chunk((" a", None, 1), (" b", None, 1)),
                _chunk(("", "stop", 1), (" c", None, 2)),
                # A finished choice keeps appearing (here even repeating its reason) while its sibling runs.
                _chunk(("", "stop", 1), ("", "length", 2)),
            ]
        }
    )
    request = _request(n=2, stream=True, echo=True, stream_options={"include_usage": True})
    chunks = await _collect(CompletionService(triton, MODEL).stream(request))
    assert [[(c.index, c.text, c.finish_reason) for c in chunk.choices] for chunk in chunks] == [
        [(0, "Hi a", None), (1, "Hi b", None)],
        [(0, "", "stop"), (1, " c", None)],
        [(1, "", "length")],
        [],
    ]
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 3
    assert len({chunk.id for chunk in chunks}) == 1


async def test_continuous_usage_stats_put_usage_in_every_chunk():
    triton = ScriptedTriton({"Hi": [_chunk((" a", None, 1)), _chunk((" b", "length", 2))]})
    request = _request(stream=True, stream_options={"continuous_usage_stats": True})
    chunks = await _collect(CompletionService(triton, MODEL).stream(request))
    assert [chunk.usage.completion_tokens for chunk in chunks] == [1, 2]


async def test_request_ending_without_finish_reason_is_an_error():
    triton = ScriptedTriton({"Hi": [_chunk((" a", None, 1))]})
    with pytest.raises(AdapterError) as raised:
        await CompletionService(triton, MODEL).complete(_request())
    assert raised.value.status_code == 500


async def test_failure_of_one_prompt_cancels_the_others():
    triton = ScriptedTriton(
        {"a": [_chunk((" a", None, 1))], "b": [invalid_request("bad prompt")]}, hang_after_script=True
    )
    with pytest.raises(AdapterError) as raised:
        await CompletionService(triton, MODEL).complete(_request(prompt=["a", "b"]))
    assert raised.value.status_code == 400
    await asyncio.sleep(0)
    assert sorted(triton.closed) == ["a", "b"]


async def test_closing_a_stream_early_closes_every_triton_stream():
    triton = ScriptedTriton({"a": [_chunk((" a", None, 1))], "b": [_chunk((" b", None, 1))]}, hang_after_script=True)
    chunks = CompletionService(triton, MODEL).stream(_request(prompt=["a", "b"], stream=True))
    await anext(chunks)
    await chunks.aclose()
    await asyncio.sleep(0)
    assert sorted(triton.closed) == ["a", "b"]


async def test_cancelling_the_consumer_closes_every_triton_stream():
    triton = ScriptedTriton({"a": [], "b": []}, hang_after_script=True)
    streams = [triton.generate(p, {}, stream=True, return_logprobs=False, request_id=p) for p in "ab"]
    consumer = asyncio.ensure_future(_collect(merge(streams)))
    await asyncio.sleep(0.01)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await asyncio.sleep(0)
    assert sorted(triton.closed) == ["a", "b"]


def _events_payloads(events: list[str]) -> list:
    assert all(event.startswith("data: ") and event.endswith("\n\n") for event in events)
    return [event[len("data: ") : -2] for event in events]


def test_chunk_event_leaves_out_absent_usage():
    chunk = CompletionResponse(id="cmpl-1", created=1, model=MODEL, choices=[])
    assert "usage" not in json.loads(_events_payloads([chunk_event(chunk)])[0])


async def test_error_after_the_first_chunk_becomes_an_error_event_then_done():
    first = CompletionResponse(id="cmpl-1", created=1, model=MODEL, choices=[])

    async def failing_rest():
        raise invalid_request("boom")
        yield  # makes this an async generator

    payloads = _events_payloads(await _collect(completion_events(first, failing_rest())))
    assert json.loads(payloads[0])["id"] == "cmpl-1"
    assert json.loads(payloads[1]) == {
        "error": {"message": "boom", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert payloads[2] == "[DONE]"
    assert DONE_EVENT == "data: [DONE]\n\n"
