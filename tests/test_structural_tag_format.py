"""xgrammar's structural tag `format` tree translated into llguidance grammars: each grammar accepts and rejects
example texts as xgrammar's format says (the matcher on the default model's tokenizer), and what does not map
is refused naming the field's path."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from llguidance import LLMatcher
from transformers import AutoTokenizer

from tritonllm.interface.errors import InvalidRequest
from tritonllm.engine.processing.grammar_compiler import structural_tag_lark

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def accepts(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def check(fmt: dict, text: str) -> bool:
        grammar = structural_tag_lark(json.dumps({"type": "structural_tag", "format": fmt}))
        matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    return check


def _tag(begin, content, end):
    return {"type": "tag", "begin": begin, "content": content, "end": end}


CASES = [  # format, accepted texts, rejected texts
    ({"type": "const_string", "value": "Hello!"}, ["Hello!"], ["Hello", "Hello!!"]),
    ({"type": "json_schema", "json_schema": SCHEMA}, ['{"n": 3}', '{"n":3}'], ['{"n": "3"}', '{}']),
    ({"type": "regex", "pattern": r"\d{2}-[a-z]+"}, ["12-ab"], ["1-ab", "12-AB"]),
    ({"type": "grammar", "grammar": 'root ::= "yes" | "no"'}, ["yes", "no"], ["maybe"]),
    ({"type": "grammar", "grammar": 'start: "a"+'}, ["aaa"], ["b"]),
    ({"type": "sequence", "elements": [{"type": "const_string", "value": "Answer: "},
                                       {"type": "regex", "pattern": "[0-9]+"}]}, ["Answer: 42"], ["Answer: x"]),
    ({"type": "or", "elements": [{"type": "const_string", "value": "A"}, {"type": "json_schema",
                                                                          "json_schema": SCHEMA}]},
     ["A", '{"n": 1}'], ["B"]),
    (_tag("<r>", {"type": "json_schema", "json_schema": SCHEMA}, "</r>"), ['<r>{"n": 1}</r>'],
     ['<r>{"n": 1}', "<r>x</r>"]),
    (_tag("<t>", {"type": "any_text"}, ["</t>", "</end>"]), ["<t>free text</t>", "<t>x</end>"],
     ["<t>a</t>b</t>", "<t>open"]),
    (_tag("<t>", {"type": "any_text", "excludes": ["a (b"]}, "</t>"), ["<t>a b</t>"], ["<t>xa (b</t>"]),
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "END"},
                                       {"type": "regex", "pattern": "[0-9]"}]},
     ["some words END7", "END1"], ["some END words END7", "words END"]),
    ({"type": "any_text", "excludes": ["<x>"]}, ["anything", ""], ["a <x> b"]),
    ({"type": "triggered_tags", "triggers": ["<function="],
      "tags": [_tag("<function=add>", {"type": "json_schema", "json_schema": SCHEMA}, "</function>"),
               _tag("<function=neg>", {"type": "json_schema", "json_schema": SCHEMA}, "</function>")]},
     ["plain text", 'a <function=add>{"n": 1}</function> b <function=neg>{"n": 2}</function>'],
     ['<function=mul>{"n": 1}</function>', '<function=add>{"x": 1}</function>']),
    ({"type": "triggered_tags", "triggers": ["<f>"], "at_least_one": True,
      "tags": [_tag("<f>", {"type": "regex", "pattern": "[a-z]+"}, "</f>")]},
     ["x <f>ab</f> y"], ["no tag at all"]),
    ({"type": "triggered_tags", "triggers": ["<f>"], "at_least_one": True, "stop_after_first": True,
      "tags": [_tag("<f>", {"type": "regex", "pattern": "[a-z]+"}, "</f>")]},
     ["x <f>ab</f>", "<f>a</f>"], ["x <f>ab</f> y", "x"]),
    ({"type": "triggered_tags", "triggers": ["<f>"], "excludes": ["STOP"],
      "tags": [_tag("<f>", {"type": "regex", "pattern": "[a-z]+"}, "</f>")]},
     ["x <f>ab</f>"], ["x STOP"]),
    ({"type": "tags_with_separator", "separator": ",",
      "tags": [_tag("<a>", {"type": "regex", "pattern": "[0-9]+"}, "</a>")]},
     ["", "<a>1</a>", "<a>1</a>,<a>22</a>"], ["<a>1</a>;<a>2</a>", "x"]),
    ({"type": "tags_with_separator", "separator": ",", "at_least_one": True, "stop_after_first": True,
      "tags": [_tag("<a>", {"type": "regex", "pattern": "[0-9]+"}, "</a>")]},
     ["<a>1</a>"], ["", "<a>1</a>,<a>2</a>"]),
    ({"type": "sequence", "elements": [  # a reasoning block, then a tool call or text: formats nest
        _tag("<think>", {"type": "any_text"}, "</think>"),
        {"type": "triggered_tags", "triggers": ["<tool>"],
         "tags": [_tag("<tool>", {"type": "json_schema", "json_schema": SCHEMA}, "</tool>")]}]},
     ['<think>hmm</think>ok <tool>{"n": 5}</tool>'], ['ok <tool>{"n": 5}</tool>', '<think>a</think><tool>x</tool>']),
]


@pytest.mark.parametrize("fmt, accepted, rejected", CASES,
                         ids=[f"{case[0]['type']}-{index}" for index, case in enumerate(CASES)])
def test_format_accepts_what_xgrammar_would(accepts, fmt, accepted, rejected):
    for text in accepted:
        assert accepts(fmt, text), text
    for text in rejected:
        assert not accepts(fmt, text), text


@pytest.mark.parametrize("fmt, path", [
    ({"type": "qwen_xml_parameter", "json_schema": SCHEMA}, "format.type"),
    ({"type": "json_schema", "json_schema": SCHEMA, "style": "qwen_xml"}, "format.style"),
    ({"type": "const_string"}, "format.value"),
    ({"type": "const_string", "value": 3}, "format.value"),
    ({"type": "const_string", "value": "x", "extra": 1}, "format.extra"),
    ({"type": "sequence", "elements": []}, "format.elements"),
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "regex", "pattern": "a"}]}, "format.elements[0]"),
    ({"type": "regex", "pattern": "(unclosed"}, "format.pattern"),
    ({"type": "grammar", "grammar": "root ::= ("}, "format.grammar"),
    ({"type": "or", "elements": [{"type": "const_string", "value": "a"}, "b"]}, "format.elements[1]"),
    ({"type": "triggered_tags", "triggers": ["<f"], "tags": [_tag("<g>", {"type": "any_text"}, "</g>")]},
     "format.tags[0].begin"),
    ({"type": "triggered_tags", "triggers": [], "tags": [_tag("<g>", {"type": "any_text"}, "</g>")]},
     "format.triggers"),
    ({"type": "triggered_tags", "triggers": ["<g>"], "tags": [{"type": "const_string", "value": "x"}]},
     "format.tags[0].type"),
    ({"type": "sequence", "elements": [
        {"type": "triggered_tags", "triggers": ["<g>"], "tags": [_tag("<g>", {"type": "any_text"}, "</g>")]},
        {"type": "const_string", "value": "x"}]}, "format.elements[0]"),
    ({"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": []}, "format.end"),
    ({"type": "tags_with_separator", "separator": ",", "tags": [], "at_least_one": "yes"}, "format.at_least_one"),
])
def test_unmappable_or_malformed_formats_name_the_field(fmt, path):
    with pytest.raises(InvalidRequest) as raised:
        structural_tag_lark(json.dumps({"type": "structural_tag", "format": fmt}))
    assert raised.value.param == "structural_tag"
    assert raised.value.message.startswith(f"invalid structural_tag: {path} "), raised.value.message
