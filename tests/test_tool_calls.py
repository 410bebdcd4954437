"""Tool calling's pieces without a running engine: the request rules, the call grammar (llguidance with the default
model's tokenizer), the streaming parser (however the text is split), the template choice, the output processor's
deltas and finish reason, and the Triton tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llguidance import LLMatcher
import llguidance.hf

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.engine_core import ModelLimits
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.parameters import SamplingParams
from tritonllm.interface.tools import template_message, tool_spec
from tritonllm.engine.processing.input_processor import InputProcessor, PromptOptions, load_tokenizer
from tritonllm.engine.processing.output_processor import OutputProcessor
from tritonllm.engine.processing.tool_calls import ToolCallParser, merge_tool_call_deltas, tool_call_lark
from tritonllm.engine.processing.outputs import RequestOutput
from tritonllm.engine.triton_io import ResponseBuilder, parse_request
from core_fakes import PieceTokenizer, core_output

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, CLOCK]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.mark.parametrize("tools, choice, param, message", [
    ([], None, "tools", "non-empty list"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools", "not unique"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools", "parameters"),
    (TOOLS, "maybe", "tool_choice", "one of"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not among the tools"),
    (None, "required", "tool_choice", "needs tools"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, choice, param, message):
    with pytest.raises(InvalidRequest) as caught:
        tool_spec(tools, choice, None)
    assert caught.value.param == param and message in caught.value.message


def test_tool_choice_defaults_and_named_function():
    assert tool_spec(TOOLS, None, None).choice == "auto" and tool_spec(None, None, None) is None
    assert tool_spec(None, "none", None) is None
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "now"}}, False)
    assert named.callable_functions() == [CLOCK["function"]] and not named.parallel


@pytest.mark.parametrize("message, error", [
    ({"role": "tool", "content": "18"}, "tool_call_id"),
    ({"role": "user"}, "needs a content"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "only assistant"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "arguments"),
    ({"role": "assistant", "content": "x", "tool_calls": []}, "non-empty"),
])
def test_bad_messages_are_refused(message, error):
    with pytest.raises(ValueError, match=error):
        template_message(message, 0, str)


def test_a_call_message_reaches_the_template_with_object_arguments():
    message = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                    "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert template_message(message, 0, str) == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}


def _parse(text: str, step: int) -> tuple[str, list[dict], list[dict]]:
    parser, content, deltas = ToolCallParser(), "", []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] + [""]
    for index, piece in enumerate(pieces):
        new_content, new_deltas = parser.feed(piece, final=index == len(pieces) - 1)
        content, deltas = content + new_content, deltas + new_deltas
    calls = []
    merge_tool_call_deltas(calls, deltas)
    return content, calls, deltas


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_the_parser_gives_the_same_calls_however_the_text_is_split(step):
    tricky = r'{"x": "}\" \n</tool_call>"}'  # a string holding a brace, an escaped quote and the closing markup
    text = 'Let me check. ' + CALL + '\n<tool_call>\n{"name": "now", "arguments": ' + tricky + '}\n</tool_call>'
    content, calls, deltas = _parse(text, step)
    assert content == "Let me check. "
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", tricky)]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    firsts = [d for d in deltas if "id" in d]
    assert [d["index"] for d in firsts] == [0, 1] and all(d["function"]["arguments"] == "" for d in firsts)


def test_text_that_only_looks_like_a_call_stays_content():
    assert _parse("a <tool_ b <tool_call>no json", 2)[:2] == ("a <tool_ b <tool_call>no json", [])


def test_an_unfinished_call_keeps_its_arguments():
    content, calls, _ = _parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', 4)
    assert content == "" and calls[0]["function"]["arguments"] == '{"city": "Pa'


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])


def _accepts(ll_tokenizer, tokenizer, spec, text: str) -> tuple[bool, bool]:
    """(the grammar takes all of text, and may end there)"""
    matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(tool_call_lark(spec)), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text)
    return matcher.try_consume_tokens(ids) == len(ids), matcher.is_accepting()


@pytest.mark.parametrize("choice, parallel, text, taken, complete", [
    ("required", False, CALL, True, True),
    ("required", False, "Sure! " + CALL, False, False),  # required: nothing but calls
    ("required", False, CALL.replace('"c"', '"kelvin"'), False, False),  # an enum the schema lacks
    ("required", False, CALL.replace('"city": "Paris", ', ""), False, False),  # a required field missing
    ("required", True, CALL + "\n" + CALL, True, True),
    ("required", False, CALL + "\n" + CALL, False, True),  # parallel_tool_calls false: one call
    ("now", False, CALL, False, False),  # a named function: only that one
    ("now", False, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True, True),
    ("auto", False, "Just text, no call.", True, True),
    ("auto", False, "Let me look. " + CALL, True, True),
    ("auto", False, "Let me look. " + CALL.replace('"Paris"', "Paris"), False, False),  # after the trigger: JSON
])
def test_the_call_grammar(ll_tokenizer, tokenizer, choice, parallel, text, taken, complete):
    tool_choice = choice if choice in ("auto", "required") else {"type": "function", "function": {"name": choice}}
    spec = tool_spec(TOOLS, tool_choice, parallel)
    assert _accepts(ll_tokenizer, tokenizer, spec, text) == (taken, complete)


def _processor(tokenizer, grammars=None) -> InputProcessor:
    limits = ModelLimits(name="m", vocab_size=len(tokenizer), max_model_len=4096, capacity=4096, is_moe=False,
                         arch=None)
    return InputProcessor(EngineConfig(), limits, tokenizer, grammars=grammars)


def test_a_model_without_tool_support_gets_the_hermes_template(tokenizer):
    processor = _processor(tokenizer)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                template_message({"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, 1, str),
                {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]
    text = processor.tokenize(messages, PromptOptions(tools=tool_spec(TOOLS, None, None))).text
    assert "<tools>\n" + json.dumps(WEATHER) in text and "<tool_call>\n{\"name\": <function-name>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    plain = processor.tokenize(messages[:1], PromptOptions()).text
    assert "SmolLM" in plain and "<tools>" not in plain  # without tools: the model's own template


def test_a_template_that_renders_tools_is_used(tokenizer):
    own = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    own.chat_template = "{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}" \
                        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    text = _processor(own).tokenize([{"role": "user", "content": "hi"}],
                                    PromptOptions(tools=tool_spec(TOOLS, None, None))).text
    assert text == "TOOL get_weather;TOOL now;user: hi\n"


class _Grammars:
    def __init__(self):
        self.compiled = []

    def compile(self, name, text, reasoning=None):
        assert reasoning is None  # (the model's template writes no reasoning tags)
        self.compiled.append((name, text))
        return None


def test_the_request_gets_the_call_grammar_or_a_named_error(tokenizer):
    grammars = _Grammars()
    processor = _processor(tokenizer, grammars)
    messages = [{"role": "user", "content": "hi"}]
    processor.process("r", messages, SamplingParams(max_tokens=5), PromptOptions(tools=tool_spec(TOOLS, "required",
                                                                                                  None)))
    assert grammars.compiled == [("tools", tool_call_lark(tool_spec(TOOLS, "required", None)))]
    processor.process("r", messages, SamplingParams(max_tokens=5), PromptOptions(tools=tool_spec(TOOLS, "none",
                                                                                                  None)))
    assert len(grammars.compiled) == 1  # none: the model writes freely
    with pytest.raises(InvalidRequest) as caught:
        processor.process("r", messages, SamplingParams(max_tokens=5, regex="a+"),
                          PromptOptions(tools=tool_spec(TOOLS, None, None)))
    assert caught.value.param == "tool_choice"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}
    with pytest.raises(InvalidRequest) as caught:
        processor.process("r", messages, SamplingParams(max_tokens=5), PromptOptions(tools=tool_spec(
            [WEATHER, bad], None, None)))
    assert caught.value.param == "tools" and "tools[1].function.parameters" in caught.value.message


def _stream_through_output_processor(pieces: list[str], finish_reason: str):
    tokenizer = PieceTokenizer()
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", tokenizer.ids("Q"), SamplingParams(), tool_spec(TOOLS, "auto", None))
    deltas = []
    ids = tokenizer.ids(*pieces)
    for i, token_id in enumerate(ids):
        output, _ = processor.process(core_output("r", [token_id], finish_reason if i == len(ids) - 1 else None))
        deltas += output.choices if output else []
    return deltas


def test_output_processing_streams_content_then_call_deltas_and_says_tool_calls():
    pieces = ["Sure", ". <tool", "_call>\n", '{"name": "get_weather", ', '"arguments": {"ci', 'ty": "Paris"}',
              "}\n</tool_call>"]
    deltas = _stream_through_output_processor(pieces, "stop")
    assert "".join(d.text for d in deltas) == "Sure. "
    calls = []
    for delta in deltas:
        merge_tool_call_deltas(calls, delta.tool_calls)
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]
    assert sum(len(d.tool_calls) for d in deltas) >= 3  # the name, then argument fragments as they come
    # a text answer keeps its finish reason
    assert [d.finish_reason for d in _stream_through_output_processor(["No", " call"], "stop")
            if d.finish_reason] == ["stop"]


def _triton_inputs(**values) -> dict:
    inputs = {"messages": np.array([json.dumps([{"role": "user", "content": "hi"}]).encode()], dtype=np.object_)}
    for name, value in values.items():
        inputs[name] = np.array([value.encode() if isinstance(value, str) else value],
                                dtype=np.object_ if isinstance(value, str) else None)
    return inputs


def test_triton_tool_inputs():
    parsed = parse_request(_triton_inputs(tools=json.dumps(TOOLS), tool_choice=json.dumps(
        {"type": "function", "function": {"name": "now"}}), parallel_tool_calls=False))
    assert parsed.options.tools == tool_spec(TOOLS, {"type": "function", "function": {"name": "now"}}, False)
    assert parse_request(_triton_inputs(tools=json.dumps(TOOLS))).options.tools.choice == "auto"
    for inputs, param in ((_triton_inputs(tools="[not json"), "tools"),
                          (_triton_inputs(tool_choice="required"), "tool_choice"),
                          (_triton_inputs(tools=json.dumps(TOOLS), tool_choice="{bad"), "tool_choice")):
        with pytest.raises(InvalidRequest) as caught:
            parse_request(inputs)
        assert caught.value.param == param
    messages = json.dumps([{"role": "tool", "content": "18"}])
    with pytest.raises(InvalidRequest) as caught:
        parse_request({"messages": np.array([messages.encode()], dtype=np.object_)})
    assert caught.value.param == "messages" and "tool_call_id" in caught.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_triton_tool_calls_output(stream):
    parsed = parse_request(_triton_inputs(tools=json.dumps(TOOLS), tool_choice="required", stream=stream))
    builder = ResponseBuilder(parsed)
    deltas = _stream_through_output_processor(
        ['<tool_call>\n{"name": "now", "arguments": {', "}}\n</tool_call>"], "stop")
    sent = []
    for index, delta in enumerate(deltas):
        tensors = builder.on_output(RequestOutput("r", [delta], 1, 0, finished=index == len(deltas) - 1))
        if tensors is not None:
            sent.append(json.loads(tensors["tool_calls"][0]))
    if stream:
        calls = []
        for response in sent:
            merge_tool_call_deltas(calls, response)
    else:
        (calls,) = sent
    assert [c["function"] for c in calls] == [{"name": "now", "arguments": "{}"}] and calls[0]["type"] == "function"
