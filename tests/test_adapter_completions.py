"""Completion assembly, SSE framing, logprobs and cancellation, against a scripted stand-in for Triton."""

import asyncio
import json

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from tritonllm.adapter.completions import CompletionService, sampling_parameters
from tritonllm.adapter.concurrency import merge
from tritonllm.adapter.errors import AdapterError, invalid_request
from tritonllm.adapter.logprobs import LogprobsAccumulator, completion_logprobs
from tritonllm.adapter.protocol import CompletionRequest, CompletionResponse
from tritonllm.adapter.sse import DONE_EVENT, chunk_event, completion_events
from tritonllm.adapter.triton_client import ChoiceOutput, GenerateRequest, TritonChunk, _parse_response

MODEL = "test-model"


def _request(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, "prompt": "Hi", **fields})


def _chunk(*choices: tuple, prompt_tokens: int = 2, prompt_logprobs: list | None = None) -> TritonChunk:
    """A response whose choices are (text, finish_reason, num_output_tokens[, logprob entries[, matched_stop]])."""
    return TritonChunk(
        choices=[
            ChoiceOutput(text, finish, list(rest[0]) if rest else [], tokens, rest[1] if len(rest) > 1 else None)
            for text, finish, tokens, *rest in choices
        ],
        num_input_tokens=prompt_tokens,
        num_cached_tokens=1,
        prompt_logprobs=prompt_logprobs,
    )


def _entry(token: str, logprob: float | None, token_id: int = 0, rank: int | None = 1, **top: tuple) -> dict:
    """An engine logprobs entry (vllm_backend's): the token, then alternatives given as id=(text, logprob)."""
    entry = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": token}}
    for position, (alternative, (text, value)) in enumerate(top.items(), start=1):
        entry.setdefault(alternative.removeprefix("t"), {"logprob": value, "rank": position, "decoded_token": text})
    return entry


class ScriptedTriton:
    """Plays back a list of responses (or an exception) per prompt; remembers which streams were closed."""

    def __init__(self, scripts: dict, hang_after_script: bool = False) -> None:
        self.scripts = scripts
        self.hang_after_script = hang_after_script
        self.calls: list[dict] = []
        self.closed: list = []

    async def generate(self, request, request_id):
        prompt = request.prompt
        self.calls.append({"prompt": prompt, "parameters": request.sampling_parameters, "stream": request.stream})
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


def test_sampling_parameters_carry_only_what_differs_from_the_engine_defaults():
    assert sampling_parameters(_request()) == {}  # OpenAI's max_tokens default (16) is the engine's too
    parameters = sampling_parameters(_request(max_tokens=None, stop="\n", seed=0, top_k=5))
    assert parameters == {"max_tokens": None, "top_k": 5, "seed": 0, "stop": ["\n"]}  # null: up to the context end
    assert sampling_parameters(_request(max_tokens=0, logprobs=0, stop_token_ids=[7])) == {
        "max_tokens": 0, "logprobs": 0, "stop_token_ids": [7]}


def test_sampling_parameters_are_the_engine_casts_of_the_request_values():
    neutral = _request(best_of=None, frequency_penalty=0, presence_penalty=0.0, repetition_penalty=1, logit_bias={},
                       stop_regex=[], no_stop_trim=False, echo=False, temperature=1, top_p=1.0, stop=None)
    assert sampling_parameters(neutral) == {}
    parameters = sampling_parameters(
        _request(n=2, best_of=3, frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.2,
                 logit_bias={"007": -100, "42": 2.5}, stop_regex=r"\d+", no_stop_trim=True)
    )
    assert parameters == {
        "n": 2,
        "best_of": 3,
        "frequency_penalty": 0.5,
        "presence_penalty": -1.0,
        "repetition_penalty": 1.2,
        "logit_bias": {7: -100.0, 42: 2.5},  # token ids as the engine reads them (JSON keys are strings again)
        "stop_regex": [r"\d+"],
        "no_stop_trim": True,
    }
    assert sampling_parameters(_request(stop_regex=["a", "b+"]))["stop_regex"] == ["a", "b+"]


@pytest.mark.parametrize(
    "fields, prompt_logprobs",
    [
        ({}, None),
        ({"logprobs": 3}, None),
        ({"echo": True}, None),  # a text prompt echoes itself
        ({"echo": True, "logprobs": 3}, 3),
        ({"echo": True, "logprobs": 0}, 0),
        ({"echo": True, "prompt": [1, 2]}, 0),  # a token-id prompt's text comes from the prompt logprobs
        ({"echo": True, "prompt": [[1, 2], [3]], "logprobs": 2}, 2),
        ({"prompt": [1, 2]}, None),
        ({"prompt_logprobs": 2}, 2),  # vLLM's extension
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 3}, 3),  # the larger serves both
        ({"echo": True, "logprobs": 4, "prompt_logprobs": 0}, 4),
    ],
)
def test_prompt_logprobs_are_requested_for_echo_only_when_needed(fields, prompt_logprobs):
    assert sampling_parameters(_request(**fields)).get("prompt_logprobs") == prompt_logprobs


def test_logprobs_offsets_run_across_pieces():
    entries = [_entry("Hel", -0.1, 1, t1=("Hel", -0.1), t5=("He", -2.0)), _entry("lo", -0.2, 2)]
    logprobs, end = completion_logprobs(entries, start_offset=3)
    assert logprobs.tokens == ["Hel", "lo"]
    assert logprobs.token_logprobs == [-0.1, -0.2]
    assert logprobs.top_logprobs == [{"Hel": -0.1, "He": -2.0}, {"lo": -0.2}]
    assert logprobs.text_offset == [3, 6]
    assert end == 8

    accumulator = LogprobsAccumulator()
    assert accumulator.add(entries[:1]).text_offset == [0]
    assert accumulator.add(entries[1:]).text_offset == [3]
    assert accumulator.total.text_offset == [0, 3]
    assert accumulator.total.tokens == ["Hel", "lo"]


def test_logprob_tokens_named_by_id_keep_the_text_offsets():
    entries = [_entry("Hel", -0.1, 1, t5=("He", -2.0)), _entry("lo", -0.2, 2)]
    logprobs, end = completion_logprobs(entries, start_offset=0, name_by_id=True)
    assert logprobs.tokens == ["token_id:1", "token_id:2"]
    assert logprobs.top_logprobs == [{"token_id:1": -0.1, "token_id:5": -2.0}, {"token_id:2": -0.2}]
    assert logprobs.text_offset == [0, 3] and end == 5  # offsets index the text, not the names


async def test_token_ids_go_with_their_chunks_and_the_prompt_ids_with_each_choice_first():
    triton = ScriptedTriton({"Hi": [
        TritonChunk([ChoiceOutput("a", None, [], 1, None, token_ids=[7])], 2, 0, None, prompt_token_ids=[1, 2]),
        TritonChunk([ChoiceOutput("b", "stop", [], 1, None, token_ids=[8])], 2, 0, None),
    ]})
    chunks = [chunk async for chunk in CompletionService(triton, MODEL).stream(_request(stream=True,
                                                                                         return_token_ids=True))]
    dumped = [chunk.choices[0].model_dump() for chunk in chunks]
    assert [(c["token_ids"], c.get("prompt_token_ids")) for c in dumped] == [([7], [1, 2]), ([8], None)]
    whole = await CompletionService(triton, MODEL).complete(_request(return_token_ids=True))
    assert (whole.choices[0].token_ids, whole.choices[0].prompt_token_ids) == ([7, 8], [1, 2])
    plain = (await CompletionService(triton, MODEL).complete(_request())).choices[0].model_dump()
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


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
    entry = _entry(" x", -1.0, 9)
    triton = ScriptedTriton({"Hi": [_chunk((" x x", "length", 2, [entry, entry]))]})
    service = CompletionService(triton, MODEL)
    echoed = await service.complete(_request(echo=True))
    assert echoed.choices[0].text == "Hi x x"
    with_logprobs = await service.complete(_request(logprobs=1))
    assert with_logprobs.choices[0].logprobs.text_offset == [0, 2]


async def test_matched_stop_is_kept_per_choice():
    triton = ScriptedTriton(
        {"Hi": [_chunk((" a", "stop", 1, [], "\n\n"), (" b", "stop", 1, [], 2), (" c", "length", 3, [], None))]}
    )
    response = await CompletionService(triton, MODEL).complete(_request(n=3))
    assert [choice.matched_stop for choice in response.choices] == ["\n\n", 2, None]
    body = json.loads(response.model_dump_json())
    assert [choice["matched_stop"] for choice in body["choices"]] == ["\n\n", 2, None]  # null is not left out


async def test_streamed_matched_stop_comes_with_the_finish_reason():
    triton = ScriptedTriton(
        {
            "Hi": [
                _chunk((" a", None, 1), (" b", None, 1)),
                _chunk((".", "stop", 2, [], "."), (" c", None, 2)),
                _chunk(("", "stop", 2, [], "."), ("", "stop", 3, [], 0)),
            ]
        }
    )
    chunks = await _collect(CompletionService(triton, MODEL).stream(_request(n=2, stream=True)))
    assert [[(c.index, c.finish_reason, c.matched_stop) for c in chunk.choices] for chunk in chunks] == [
        [(0, None, None)], [(1, None, None)], [(0, "stop", ".")], [(1, None, None)], [(1, "stop", 0)],
    ]
    payload = json.loads(chunk_event(chunks[2])[len("data: ") :])
    assert [set(choice) for choice in payload["choices"]] == [
        {"index", "text", "logprobs", "finish_reason", "matched_stop"}
    ]


_PROMPT_LOGPROBS = [_entry("Hi", None, 10, rank=None), _entry(" there", -2.5, 11), _entry("!", -0.5, 12)]
"""The engine's prompt logprobs for "Hi there!" tokenized as "Hi", " there", "!"."""


async def test_echo_with_logprobs_puts_the_prompt_tokens_first():
    completion = [_entry(" A", -0.1, 13), _entry("B", -0.2, 14)]
    triton = ScriptedTriton({"Hi there!": [_chunk((" AB", "length", 2, completion), prompt_logprobs=_PROMPT_LOGPROBS)]})
    response = await CompletionService(triton, MODEL).complete(_request(prompt="Hi there!", echo=True, logprobs=1))
    [choice] = response.choices
    assert choice.text == "Hi there! AB"
    assert choice.logprobs.model_dump() == {
        "tokens": ["Hi", " there", "!", " A", "B"],
        "token_logprobs": [None, -2.5, -0.5, -0.1, -0.2],
        "top_logprobs": [None, {" there": -2.5}, {"!": -0.5}, {" A": -0.1}, {"B": -0.2}],
        "text_offset": [0, 2, 8, 9, 11],
    }
    assert all(choice.text[offset:].startswith(token) for token, offset in
               zip(choice.logprobs.tokens, choice.logprobs.text_offset))
    assert triton.calls[0]["parameters"]["prompt_logprobs"] == 1


async def test_streamed_echo_with_logprobs_goes_in_each_choice_first_chunk():
    triton = ScriptedTriton(
        {
            "Hi there!": [
                _chunk((" A", None, 1, [_entry(" A", -0.1)]), ("", None, 0), prompt_logprobs=_PROMPT_LOGPROBS),
                _chunk(("", "length", 1, []), (" C", "length", 1, [_entry(" C", -0.3)])),
            ]
        }
    )
    request = _request(prompt="Hi there!", n=2, echo=True, logprobs=0, stream=True)
    chunks = await _collect(CompletionService(triton, MODEL).stream(request))
    first = [choice for chunk in chunks[:2] for choice in chunk.choices]  # one choice per chunk
    assert [(c.index, c.text) for c in first] == [(0, "Hi there! A"), (1, "Hi there!")]
    assert first[0].logprobs.tokens == ["Hi", " there", "!", " A"]
    assert first[0].logprobs.text_offset == [0, 2, 8, 9]
    assert first[1].logprobs.token_logprobs == [None, -2.5, -0.5]
    [[finished_0], [finished_1]] = [chunk.choices for chunk in chunks[2:]]
    assert (finished_0.text, finished_0.logprobs.tokens) == ("", [])
    assert (finished_1.text, finished_1.logprobs.tokens, finished_1.logprobs.text_offset) == (" C", [" C"], [9])


async def test_echo_of_token_ids_is_the_text_of_their_prompt_logprobs():
    triton = ScriptedTriton(
        {
            "[10, 11, 12]": [_chunk((" A", "length", 1), prompt_logprobs=_PROMPT_LOGPROBS)],
            "[10, 11]": [_chunk((" B", "length", 1), prompt_logprobs=_PROMPT_LOGPROBS[:2])],
        }
    )
    response = await CompletionService(triton, MODEL).complete(_request(prompt=[[10, 11, 12], [10, 11]], echo=True))
    assert [(c.text, c.logprobs) for c in response.choices] == [("Hi there! A", None), ("Hi there B", None)]
    assert [call["parameters"]["prompt_logprobs"] for call in triton.calls] == [0, 0]


async def test_echo_without_the_prompt_logprobs_it_needs_is_an_error():
    triton = ScriptedTriton({"Hi": [_chunk((" A", "length", 1, [_entry(" A", -0.1)]))]})
    with pytest.raises(AdapterError) as raised:
        await CompletionService(triton, MODEL).complete(_request(echo=True, logprobs=0))
    assert raised.value.status_code == 500


def _infer_result(outputs: dict[str, list[bytes]]) -> InferResult:
    """tritonclient's InferResult of a gRPC response with these BYTES outputs (as Triton sends them)."""
    response = service_pb2.ModelInferResponse(model_name="llm")
    for name, values in outputs.items():
        response.outputs.add(name=name, datatype="BYTES", shape=[len(values)])
        response.raw_output_contents.append(serialize_byte_tensor(np.array(values, dtype=np.object_)).item())
    return InferResult(response)


def test_triton_response_parsing_reads_matched_stop_and_prompt_logprobs():
    chunk = _parse_response(
        _infer_result(
            {
                "text_output": [b" a", b" b", b""],
                "finish_reason": [b"stop", b"stop", b"None"],
                "matched_stop": [b'"\\n"', b"2", b"null"],
                "prompt_logprobs": [json.dumps(_PROMPT_LOGPROBS).encode()],
            }
        )
    )
    assert [(c.finish_reason, c.matched_stop) for c in chunk.choices] == [("stop", "\n"), ("stop", 2), (None, None)]
    assert chunk.prompt_logprobs == _PROMPT_LOGPROBS
    without = _parse_response(_infer_result({"text_output": [b" a"]}))
    assert (without.choices[0].matched_stop, without.prompt_logprobs) == (None, None)


async def test_suffix_is_refused_before_reaching_triton():
    triton = ScriptedTriton({})
    with pytest.raises(AdapterError) as raised:
        await CompletionService(triton, MODEL).complete(_request(suffix=" end"))
    assert (raised.value.status_code, raised.value.param) == (400, "suffix")
    assert triton.calls == []


async def test_stream_gives_each_choice_one_finish_chunk_and_usage_last():
    triton = ScriptedTriton(
        {
            "Hi": [
                _chunk((" a", None, 1), (" b", None, 1)),  # (each response counts its own tokens)
                _chunk(("", "stop", 0), (" c", None, 1)),
                # A finished choice keeps appearing with its reason while its sibling runs.
                _chunk(("", "stop", 0), ("", "length", 0)),
            ]
        }
    )
    request = _request(n=2, stream=True, echo=True, stream_options={"include_usage": True})
    chunks = await _collect(CompletionService(triton, MODEL).stream(request))
    assert [[(c.index, c.text, c.finish_reason) for c in chunk.choices] for chunk in chunks] == [
        [(0, "Hi a", None)], [(1, "Hi b", None)], [(0, "", "stop")], [(1, " c", None)], [(1, "", "length")], [],
    ]
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 3
    assert len({chunk.id for chunk in chunks}) == 1


async def test_continuous_usage_stats_put_usage_in_every_chunk():
    triton = ScriptedTriton({"Hi": [_chunk((" a", None, 1)), _chunk((" b", "length", 1))]})
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


@pytest.mark.parametrize("prompts", ["a", "ab"])  # one stream is read in place, several through tasks
async def test_cancelling_the_consumer_closes_every_triton_stream(prompts):
    triton = ScriptedTriton({p: [] for p in prompts}, hang_after_script=True)
    streams = [triton.generate(GenerateRequest(p, {}, stream=True), request_id=p) for p in prompts]
    consumer = asyncio.ensure_future(_collect(merge(streams)))
    await asyncio.sleep(0.01)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await asyncio.sleep(0)
    assert sorted(triton.closed) == list(prompts)


@pytest.mark.parametrize("prompts", ["a", "ab"])
async def test_closing_the_merge_early_closes_every_triton_stream(prompts):
    triton = ScriptedTriton({p: [_chunk((f" {p}", None, 1))] for p in prompts}, hang_after_script=True)
    merged = merge([triton.generate(GenerateRequest(p, {}, stream=True), request_id=p) for p in prompts])
    await anext(merged)
    await merged.aclose()
    await asyncio.sleep(0)
    assert sorted(triton.closed) == list(prompts)


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


def _routed(text: str, finish: str | None, tokens: int, *routing: list) -> ChoiceOutput:
    """A choice output whose new tokens were routed as `routing` ([layers][top_k] per token)."""
    return ChoiceOutput(text, finish, [], tokens, None, routed_experts=list(routing))


async def test_routed_experts_go_in_sglext_per_choice_index_and_only_when_asked():
    a0, a1, b0 = [[0, 1], [2, 3]], [[1, 0], [3, 2]], [[2, 0], [1, 3]]
    responses = [TritonChunk([_routed(" a", None, 1, a0), _routed(" b", None, 1, b0)], 2, 0, None),
                 TritonChunk([_routed("!", "stop", 2, a1), _routed("", "length", 1)], 2, 0, None)]
    service = CompletionService(ScriptedTriton({"Hi": responses}), MODEL)
    response = await service.complete(_request(n=2, return_routed_experts=True))
    body = json.loads(response.model_dump_json())
    assert body["sglext"] == {"routed_experts": [[a0, a1], [b0]]}
    assert all("routed_experts" not in choice for choice in body["choices"])

    chunks = await _collect(service.stream(_request(n=2, stream=True, return_routed_experts=True,
                                                    stream_options={"include_usage": True})))
    assert [json.loads(chunk.model_dump_json()).get("sglext") for chunk in chunks] == [
        {"routed_experts": [[a0], []]},  # one choice per chunk; a choice it does not carry: none
        {"routed_experts": [[], [b0]]},
        {"routed_experts": [[a1], []]},
        {"routed_experts": [[], []]},  # choice 1 ends without a new token
        None,  # the usage chunk has no choices
    ]
    plain = await CompletionService(ScriptedTriton({"Hi": responses}), MODEL).complete(_request(n=2))
    assert "sglext" not in json.loads(plain.model_dump_json())
    assert sampling_parameters(_request(return_routed_experts=True))["return_routed_experts"] is True


def test_triton_response_parsing_reads_routed_experts():
    chunk = _parse_response(_infer_result({"text_output": [b" a", b" b"], "routed_experts": [b"[[[0, 1]]]", b"[]"]}))
    assert [choice.routed_experts for choice in chunk.choices] == [[[[0, 1]]], []]


async def test_cached_tokens_details_count_each_tier_summed_over_the_prompts_only_when_asked():
    def done(cached: int, tiers: list[int]) -> TritonChunk:
        return TritonChunk([ChoiceOutput(" x", "stop", [], 1, None)], 40, cached, None, cached_tokens_details=tiers)

    triton = ScriptedTriton({"a": [done(12, [4, 8, 0])], "b": [done(32, [0, 16, 16])], "c": [done(4, [4, 0, 0])]})
    service = CompletionService(triton, MODEL)
    response = await service.complete(_request(prompt=["a", "b"], return_cached_tokens_details=True))
    assert response.usage.prompt_tokens_details.cached_tokens == 44
    assert json.loads(response.model_dump_json())["sglext"] == {
        "cached_tokens_details": {"device": 4, "host": 24, "storage": 16, "storage_backend": "file"}}
    device_only = await service.complete(_request(prompt="c", return_cached_tokens_details=True))
    assert json.loads(device_only.model_dump_json())["sglext"] == {
        "cached_tokens_details": {"device": 4, "host": 0, "storage": 0, "storage_backend": None}}
    assert (await service.complete(_request(prompt="a"))).sglext is None
