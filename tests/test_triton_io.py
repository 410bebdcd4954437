"""The Triton tensor interface as pure functions: parsing inputs, building streaming and final responses."""

import json
import re

import numpy as np
import pytest
import torch

from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.tensors import TOKENIZE_OUTPUTS
from tritonllm.engine.processing.input_processor import PromptOptions, TokenizedPrompt
from tritonllm.engine.processing.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from tritonllm.engine.triton_io import (ResponseBuilder, cancel_target, cancel_tensors, instance_tensors, parse_request,
                                        tokenized_tensors)


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


def test_streaming_responses_carry_deltas_and_each_choice_state():
    builder = ResponseBuilder(parse_request(inputs({"n": 2}, stream=True, return_finish_reason=True,
                                                   return_matched_stop=True, return_num_output_tokens=True)))
    first = builder.on_output(RequestOutput("r", [delta(0, "a"), delta(1, "b")], 1, 0, False))
    second = builder.on_output(RequestOutput("r", [delta(0, "c", "stop", tokens=3, matched=" end")], 1, 0, False))
    third = builder.on_output(RequestOutput("r", [delta(1, "d", "length", tokens=2)], 1, 0, True))
    # vllm_backend's conventions: "None" while running, and each response counts its own tokens
    assert first["text_output"].tolist() == [b"a", b"b"] and first["finish_reason"].tolist() == [b"None", b"None"]
    assert first["num_output_tokens"].tolist() == [1, 1]
    assert second["finish_reason"].tolist() == [b"stop", b"None"] and second["num_output_tokens"].tolist() == [2, 0]
    assert second["matched_stop"].tolist() == [b'" end"', b"null"]
    assert third["text_output"].tolist() == [b"", b"d"] and third["finish_reason"].tolist() == [b"stop", b"length"]
    assert third["num_output_tokens"].tolist() == [0, 1]


@pytest.mark.parametrize("flags", [{"return_num_output_tokens": True}, {}])  # the count kept either way
def test_a_stream_interval_gathers_tokens_into_fewer_responses(flags):
    builder = ResponseBuilder(parse_request(inputs({"n": 2}, stream=True, **flags)), stream_interval=3)
    made = {"a": 0, "b": 0}

    def output(texts: dict, finished=False):
        choices = []
        for index, (name, text) in enumerate(texts.items()):
            made[name] += 1
            choices.append(delta(index, text, "length" if finished else None, tokens=made[name]))
        return builder.on_output(RequestOutput("r", choices, 1, 0, finished))

    sent = [output({"a": "1", "b": "x"})]  # the first token at once
    sent += [output({"a": str(i), "b": "y"}) for i in (2, 3, 4)]  # the third new token completes a chunk
    sent += [output({"a": "5", "b": "z"}, finished=True)]  # the last at once
    assert [response is not None for response in sent] == [True, False, False, True, True]
    assert [r["text_output"].tolist() for r in sent if r is not None] == [[b"1", b"x"], [b"234", b"yyy"],
                                                                          [b"5", b"z"]]
    if flags:
        assert [r["num_output_tokens"].tolist() for r in sent if r is not None] == [[1, 1], [3, 3], [1, 1]]


def test_logprobs_are_vllm_backend_entries_and_null_when_not_asked():
    sampled = TokenLogprob(7, " x", -2.0, [(3, " a", -0.5), (7, " x", -2.0)], rank=2)
    outside = TokenLogprob(9, " y", -4.0, [(3, " a", -0.5)], rank=5)
    builder = ResponseBuilder(parse_request(inputs({"logprobs": 1}, stream=True, return_logprobs=True)))
    out = builder.on_output(RequestOutput("r", [ChoiceDelta(0, " x y", [sampled, outside], -6.0, 2, None)], 1, 0,
                                          False))
    assert json.loads(out["logprobs"][0]) == [
        {"7": {"logprob": -2.0, "rank": 2, "decoded_token": " x"}, "3": {"logprob": -0.5, "rank": 1, "decoded_token": " a"}},
        {"9": {"logprob": -4.0, "rank": 5, "decoded_token": " y"}, "3": {"logprob": -0.5, "rank": 1, "decoded_token": " a"}},
    ]
    plain = ResponseBuilder(parse_request(inputs({}, return_logprobs=True)))
    assert plain.on_output(RequestOutput("r", [delta(0, "a", "stop")], 1, 0, True))["logprobs"].tolist() == [b"null"]


@pytest.mark.parametrize("flags, refused", [
    ({"stream": True, "exclude_input_in_output": False}, True),
    ({"stream": True}, False),
    ({"stream": True, "exclude_input_in_output": True}, False),
    ({"exclude_input_in_output": False}, False),
])
def test_streaming_the_prompt_is_refused_as_vllm_backend(flags, refused):
    if refused:
        with pytest.raises(InvalidRequest, match="exclude_input_in_output false cannot be streamed"):
            parse_request(inputs({}, **flags))
    else:
        parse_request(inputs({}, **flags))


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
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]  # OpenAI's content parts
    assert parse_request({"messages": _messages_input([{"role": "user", "content": parts}])}).prompt == [
        {"role": "user", "content": "hi there"}]


@pytest.mark.parametrize("values, message", [
    ({"messages": np.array([b"not json"], dtype=np.object_)}, "not valid JSON"),
    ({"messages": _messages_input([])}, "non-empty JSON list"),
    ({"messages": _messages_input([{"role": "wizard", "content": "a"}])}, "messages[0]"),
    ({"messages": _messages_input([{"role": "user", "content": None}])}, "needs a content"),
    ({"messages": _messages_input([{"role": "user", "content": [{"type": "image_url"}]}])}, "'image_url' are not"),
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


def test_token_ids_stream_per_choice_and_the_prompt_ids_come_once():
    def tokens(index, *ids, finish=None):
        return ChoiceDelta(index, "t", [], 0.0, len(ids), finish, token_ids=list(ids))

    flags = dict(return_token_ids=True, return_prompt_token_ids=True)
    streaming = ResponseBuilder(parse_request(inputs({"n": 2}, stream=True, **flags)))
    first = streaming.on_output(RequestOutput("r", [tokens(0, 5, 6), tokens(1, 7)], 1, 0, False,
                                              prompt_token_ids=[1, 2]))
    second = streaming.on_output(RequestOutput("r", [tokens(1, 8, finish="length")], 1, 0, True))
    assert first["prompt_token_ids"].tolist() == [1, 2] and "prompt_token_ids" not in second
    assert [json.loads(v) for v in first["token_ids"]] == [[5, 6], [7]]
    assert [json.loads(v) for v in second["token_ids"]] == [[], [8]]

    whole = ResponseBuilder(parse_request(inputs({}, **flags)))
    assert whole.on_output(RequestOutput("r", [tokens(0, 5)], 1, 0, False, prompt_token_ids=[1, 2])) is None
    final = whole.on_output(RequestOutput("r", [tokens(0, 6, finish="stop")], 1, 0, True))
    assert final["prompt_token_ids"].tolist() == [1, 2] and json.loads(final["token_ids"][0]) == [5, 6]
    plain = ResponseBuilder(parse_request(inputs({})))
    tensors = plain.on_output(RequestOutput("r", [tokens(0, 5, finish="stop")], 1, 0, True, prompt_token_ids=[1]))
    assert "token_ids" not in tensors and "prompt_token_ids" not in tensors


def test_prompt_options_and_tokenize_only_are_read():
    parsed = parse_request(inputs(None, add_special_tokens=False, add_generation_prompt=False, tokenize_only=True))
    assert parsed.tokenize_only and parsed.options == PromptOptions(add_special_tokens=False,
                                                                    add_generation_prompt=False)
    assert parse_request(inputs(None)).options == PromptOptions(add_special_tokens=None, add_generation_prompt=True)
    tensors = tokenized_tensors(TokenizedPrompt([5, 6], ["Ġa", "b"], " ab"), max_model_len=128)
    assert set(tensors) == set(TOKENIZE_OUTPUTS)
    assert tensors["prompt_token_ids"].dtype == np.int32 and tensors["prompt_token_ids"].tolist() == [5, 6]
    assert tensors["prompt_token_strs"].tolist() == ["Ġa".encode(), b"b"]
    assert (tensors["text_output"].tolist(), tensors["num_input_tokens"].tolist(),
            tensors["max_model_len"].tolist()) == ([b" ab"], [2], [128])


def test_the_engine_instance_is_named_when_asked():
    assert "model_instance" in parse_request(inputs(None, return_model_instance=True)).returns
    assert {name: array.tolist() for name, array in instance_tensors("llm_0_1").items()} == {
        "model_instance": [b"llm_0_1"]}


def test_a_cancel_request_names_its_target_and_is_answered_with_one_flag():
    assert cancel_target(inputs(None)) is None  # any other request
    assert cancel_target({"cancel_request_id": np.array([b"cmpl-1-0"], dtype=np.object_)}) == "cmpl-1-0"
    with pytest.raises(InvalidRequest, match="empty"):  # would name every request sent without an id
        cancel_target({"cancel_request_id": np.array([b""], dtype=np.object_)})
    assert {name: array.tolist() for name, array in cancel_tensors(True).items()} == {"cancelled": [True]}


@pytest.mark.parametrize("extra, param", [
    ({"continue_final_message": np.array([True])}, "continue_final_message"),  # with the default generation prompt
    ({"chat_template_kwargs": np.array([b"{not json"], dtype=np.object_)}, "chat_template_kwargs"),
    ({"chat_template_kwargs": np.array([b"[1]"], dtype=np.object_)}, "chat_template_kwargs"),
])
def test_chat_template_controls_are_checked(extra, param):
    with pytest.raises(InvalidRequest) as refused:
        parse_request({**inputs(None), **extra})
    assert refused.value.param == param
    continued = parse_request({**inputs(None), "continue_final_message": np.array([True]),
                               "add_generation_prompt": np.array([False]),
                               "chat_template_kwargs": np.array([b'{"x": 1}'], dtype=np.object_)}).options
    assert (continued.continue_final_message, continued.chat_template_kwargs) == (True, {"x": 1})


def test_reasoning_streams_per_choice_and_accumulates_without_streaming():
    def thought(text, reasoning, tokens, reasoning_tokens, finish=None):
        return ChoiceDelta(0, text, [], 0.0, tokens, finish, reasoning=reasoning,
                           num_reasoning_tokens=reasoning_tokens)

    streaming = ResponseBuilder(parse_request(inputs({}, stream=True)))
    first = streaming.on_output(RequestOutput("r", [thought("", "Let", 1, 1)], 1, 0, False))
    second = streaming.on_output(RequestOutput("r", [thought("Paris", "", 3, 2, "stop")], 1, 0, True))
    assert (first["reasoning_output"].tolist(), first["text_output"].tolist()) == ([b"Let"], [b""])
    assert (second["reasoning_output"].tolist(), second["text_output"].tolist()) == ([b""], [b"Paris"])
    assert second["num_reasoning_tokens"].tolist() == [2]  # the total so far

    whole = ResponseBuilder(parse_request(inputs({})))
    assert whole.on_output(RequestOutput("r", [thought("", "Let", 1, 1)], 1, 0, False)) is None
    final = whole.on_output(RequestOutput("r", [thought("Paris", " me", 3, 2, "stop")], 1, 0, True))
    assert final["reasoning_output"].tolist() == [b"Let me"] and final["num_reasoning_tokens"].tolist() == [2]
    plain = ResponseBuilder(parse_request(inputs({})))
    assert "reasoning_output" not in plain.on_output(RequestOutput("r", [delta(0, "a", "stop")], 1, 0, True))


def test_cached_tokens_details_are_the_cached_tokens_by_tier_when_asked():
    asked = ResponseBuilder(parse_request(inputs({}, return_num_cached_tokens=True, return_cached_tokens_details=True)))
    tensors = asked.on_output(RequestOutput("r", [delta(0, "a", "stop")], 40, 28, True, cached_by_tier=(4, 8, 16)))
    assert tensors["num_cached_tokens"].tolist() == [28]
    assert tensors["cached_tokens_details"].tolist() == [4, 8, 16]
    plain = ResponseBuilder(parse_request(inputs({}, return_num_cached_tokens=True)))
    assert "cached_tokens_details" not in plain.on_output(RequestOutput("r", [delta(0, "a", "stop")], 40, 28, True))
