"""The Triton tensor interface as pure functions: parsing inputs, building streaming and final responses."""

import json
import re

import numpy as np
import pytest
import torch

from backend.processing.outputs import ChoiceDelta, RequestOutput
from backend.interface.errors import InvalidRequest
from backend.triton_io import ResponseBuilder, parse_request


def inputs(params: dict | None = None, **flags) -> dict:
    values = {"text_input": np.array([b"Hello"], dtype=np.object_)}
    if params is not None:
        values["sampling_parameters"] = np.array([json.dumps(params).encode()], dtype=np.object_)
    values.update({name: np.array([value]) for name, value in flags.items()})
    return values


def delta(index, text, finish=None, cumulative=0.0, tokens=1, matched=None):
    return ChoiceDelta(index, text, [], cumulative, tokens, finish, matched)


def test_parse_casts_strings_and_reads_flags():
    parsed = parse_request(inputs({"max_tokens": "7", "temperature": "0.5", "ignore_eos": "true", "stop": "x"},
                                  stream=True, return_finish_reason=True))
    assert parsed.prompt == "Hello" and parsed.stream
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.params.ignore_eos) == (7, 0.5, True)
    assert parsed.params.stop == ["x"] and parsed.returns == {"finish_reason"}
    tokens = parse_request({"input_ids": np.array([5, 6, 7], dtype=np.int32)})
    assert tokens.prompt == [5, 6, 7]


@pytest.mark.parametrize("values, message", [
    ({}, "needs a prompt"),
    (inputs({"temperature": "hot"}), "temperature must be a number"),
    (inputs({"top_p": 0}), "top_p"),
    (inputs({"unknown": 1}), "unsupported sampling parameter"),
    (inputs({"n": 1, "best_of": 3}, stream=True), "best_of > n cannot be streamed"),
    (inputs({"logit_bias": {"5": 101}}), r"logit_bias must be in \[-100, 100\]"),
    (inputs({"stop_regex": "("}), "not a valid regular expression"),
])
def test_parse_rejects_bad_input(values, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request(values)


def test_streaming_responses_carry_deltas_and_each_finish_once():
    builder = ResponseBuilder(parse_request(inputs({"n": 2}, stream=True, return_finish_reason=True,
                                                   return_matched_stop=True)))
    first = builder.on_output(RequestOutput("r", [delta(0, "a"), delta(1, "b")], 1, 0, False))
    second = builder.on_output(RequestOutput("r", [delta(0, "c", "stop", matched=" end")], 1, 0, False))
    third = builder.on_output(RequestOutput("r", [delta(1, "d", "length")], 1, 0, True))
    assert first["text_output"].tolist() == [b"a", b"b"] and first["finish_reason"].tolist() == [b"", b""]
    assert second["finish_reason"].tolist() == [b"stop", b""]
    assert second["matched_stop"].tolist() == [b'" end"', b"null"]
    assert third["text_output"].tolist() == [b"", b"d"] and third["finish_reason"].tolist() == [b"", b"length"]


def test_non_streaming_response_is_whole_and_best_of_keeps_the_most_likely():
    builder = ResponseBuilder(parse_request(inputs({"n": 2, "best_of": 3}, return_cumulative_logprob=True)))
    assert builder.on_output(RequestOutput("r", [delta(i, "x", cumulative=-1.0) for i in range(3)], 1, 0,
                                           False)) is None
    final = builder.on_output(RequestOutput("r", [delta(0, "a", "stop", -5.0), delta(1, "b", "stop", -1.0),
                                                  delta(2, "c", "stop", -3.0)], 1, 0, True))
    assert final["text_output"].tolist() == [b"Helloxb", b"Helloxc"]  # prompt included, best first
    assert final["cumulative_logprob"].tolist() == [-1.0, -3.0]


def _messages_input(value) -> np.ndarray:
    return np.array([json.dumps(value).encode()], dtype=np.object_)


def test_parse_messages_keeps_role_and_content_only():
    parsed = parse_request({"messages": _messages_input([{"role": "user", "content": "hi", "name": "x"}])})
    assert parsed.prompt == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("values, message", [
    ({"messages": np.array([b"not json"], dtype=np.object_)}, "not valid JSON"),
    ({"messages": _messages_input([])}, "non-empty JSON list"),
    ({"messages": _messages_input([{"role": "wizard", "content": "a"}])}, "messages[0]"),
    ({"messages": _messages_input([{"role": "user", "content": None}])}, "string content"),
    ({**inputs(), "messages": _messages_input([{"role": "user", "content": "a"}])}, "exactly one of"),
])
def test_parse_refuses_bad_messages(values, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        parse_request(values)


def test_routed_experts_stream_per_choice_and_accumulate_without_streaming():
    def routed(index, *rows):
        return ChoiceDelta(index, "t", [], 0.0, len(rows), None, routed_experts=[torch.tensor(r) for r in rows])

    streaming = ResponseBuilder(parse_request(inputs({"n": 2, "return_routed_experts": True}, stream=True)))
    first = streaming.on_output(RequestOutput("r", [routed(0, [[1, 2], [3, 0]]), routed(1, [[0, 1], [2, 3]])],
                                              1, 0, False))
    second = streaming.on_output(RequestOutput("r", [routed(1, [[3, 2], [1, 0]])], 1, 0, True))
    assert [json.loads(v) for v in first["routed_experts"]] == [[[[1, 2], [3, 0]]], [[[0, 1], [2, 3]]]]
    assert [json.loads(v) for v in second["routed_experts"]] == [[], [[[3, 2], [1, 0]]]]

    whole = ResponseBuilder(parse_request(inputs({"return_routed_experts": True})))
    assert whole.on_output(RequestOutput("r", [routed(0, [[1, 2]])], 1, 0, False)) is None
    final = whole.on_output(RequestOutput("r", [routed(0, [[0, 3]])], 1, 0, True))
    assert json.loads(final["routed_experts"][0]) == [[[1, 2]], [[0, 3]]]
    plain = ResponseBuilder(parse_request(inputs({})))
    assert "routed_experts" not in plain.on_output(RequestOutput("r", [delta(0, "a", "stop")], 1, 0, True))
