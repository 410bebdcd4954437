"""Reasoning apart from the answer: the parser on text fed in every split, where a chat's output starts, the
grammar that leaves the reasoning free and constrains the answer, and a tiny random Qwen3 with a thinking chat
template through the engine."""

from __future__ import annotations

import itertools
import json

import llguidance
import llguidance.hf
import pytest
from llguidance import LLMatcher
from transformers import AutoTokenizer

from core_fakes import PieceTokenizer, core_output
from engine_helpers import EXACT, Result, generate
from tiny_models import write_thinking_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine, Request
from tritonllm.engine.processing.grammar_compiler import after_reasoning
from tritonllm.engine.processing.input_processor import PromptOptions
from tritonllm.engine.processing.output_processor import OutputProcessor
from tritonllm.engine.processing.reasoning import (THINK_TAGS, ReasoningParser, ReasoningStart, reasoning_start,
                                                   reasoning_tags)
from tritonllm.engine.processing.tool_calls import merge_tool_call_deltas, tool_call_lark
from tritonllm.interface.parameters import SamplingParams
from tritonllm.interface.tools import tool_spec

OPEN, AT_START = ReasoningStart.OPEN, ReasoningStart.AT_START
_ids = itertools.count()


def _split(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning = answer = ""
    for index, piece in enumerate(pieces):
        more_reasoning, more_answer = parser.feed(piece, final=index == len(pieces) - 1)
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
    return reasoning, answer


@pytest.mark.parametrize("start, text, reasoning, answer", [
    (OPEN, "Let me see.\n</think>\n\nParis.", "Let me see.\n", "Paris."),
    (OPEN, "still thinking </thi", "still thinking </thi", ""),  # never ended: all reasoning
    (OPEN, "a < b </think>", "a < b ", ""),
    (AT_START, "<think>\nhmm</think>Paris.", "\nhmm", "Paris."),
    (AT_START, "Paris, no thinking.", "", "Paris, no thinking."),
    (AT_START, " <think>x</think>y", "", " <think>x</think>y"),  # a reasoning opens only at the very start
    (AT_START, "<thin", "", "<thin"),
    (OPEN, "x</think></think>y", "x", "</think>y"),  # the first end tag ends it
])
def test_every_split_of_the_text_gives_the_same_reasoning_and_answer(start, text, reasoning, answer):
    assert _split(ReasoningParser(THINK_TAGS, start), [text]) == (reasoning, answer)
    for size in (1, 2, 3):  # tags split across pieces (tokens) every way
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert _split(ReasoningParser(THINK_TAGS, start), pieces) == (reasoning, answer), size
    for cut in range(len(text) + 1):
        assert _split(ReasoningParser(THINK_TAGS, start), [text[:cut], text[cut:]]) == (reasoning, answer), cut


def test_held_back_tag_prefixes_go_out_once_they_cannot_be_a_tag():
    parser = ReasoningParser(THINK_TAGS, OPEN)
    assert parser.feed("ab</th", final=False) == ("ab", "")
    assert parser.feed("e", final=False) == ("</the", "")
    assert parser.feed("</think> \n ok", final=False) == ("", "ok")
    assert parser.reasoning_end == len("ab</the</think>")


def test_the_parser_is_picked_by_name_or_from_the_chat_template():
    assert reasoning_tags("auto", "{{ '<think>' }} ... {{ '</think>' }}") is THINK_TAGS
    assert reasoning_tags("auto", "{{ messages }}") is None and reasoning_tags("auto", None) is None
    assert reasoning_tags("none", "<think></think>") is None
    assert reasoning_tags("deepseek_r1", None) is THINK_TAGS
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_tags("qwen", None)


@pytest.mark.parametrize("prompt_end, start", [
    ("<|im_end|>\n<|im_start|>assistant\n<think>\n", OPEN),
    ("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # enable_thinking false
    ("<|im_end|>\n<|im_start|>assistant\n", AT_START),
])
def test_where_the_output_starts_is_read_off_the_prompt(prompt_end, start):
    assert reasoning_start(THINK_TAGS, prompt_end) is start


@pytest.fixture(scope="module")
def ll_tokenizer(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152, eos_token=[tokenizer.eos_token_id])


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}


@pytest.mark.parametrize("start, text, accepted", [
    (OPEN, 'I think {"x": <b> </thi</think>\n\n{"city":"Rome"}', True),  # anything goes in the reasoning
    (OPEN, '</think>{"city":"Rome"}', True),
    (OPEN, 'hm</think>Rome', False),  # the answer is constrained
    (OPEN, '{"city":"Rome"}', False),  # ... and only after the reasoning
    (AT_START, '{"city":"Paris"}', True),
    (AT_START, '<think>free {</think>{"city":"Paris"}', True),
    (AT_START, 'x<think></think>{"city":"Paris"}', False),
])
def test_a_constraint_applies_to_the_answer_after_free_reasoning(ll_tokenizer, start, text, accepted):
    tokenizer, ll = ll_tokenizer
    grammar = after_reasoning(LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                                 defaults={"whitespace_flexible": False}),
                              (THINK_TAGS, start))
    matcher = LLMatcher(ll, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    consumed = matcher.consume_tokens(tokenizer.encode(text))
    assert (consumed and matcher.is_accepting()) is accepted


# --- the engine: a tiny random Qwen3 with a thinking chat template ---------------------------------------------------

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory, default_model_dir):
    model_dir = write_thinking_model(tmp_path_factory.mktemp("thinking") / "tiny-qwen3-thinking", default_model_dir)
    return LLMEngine(EngineConfig(model_path=str(model_dir), **EXACT, kv_cache_memory=4 << 20, block_size=4))


def _chat(engine, params: SamplingParams, **template_kwargs) -> Result:
    """One chat through the engine, with the template's extra variables."""
    request = Request(f"chat-{next(_ids)}", MESSAGES, params, PromptOptions(chat_template_kwargs=template_kwargs))
    engine.add_request(request)
    result = Result(request)
    while engine.has_unfinished_requests():
        result.outputs += engine.step()
    return result


def _reasoning(result) -> str:
    return "".join(choice.reasoning or "" for output in result.outputs for choice in output.choices)


def _last(result):
    return [choice for output in result.outputs for choice in output.choices][-1]


def test_a_thinking_chat_is_all_reasoning_until_the_end_tag(thinking_engine):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    result = _chat(thinking_engine, params)
    rendered = thinking_engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<think>\n")
    [plain] = generate(thinking_engine, [rendered], SamplingParams(max_tokens=12, temperature=0.0))
    assert "</think>" not in plain.text()  # (the random model never ends its reasoning)
    assert _reasoning(result) == plain.text() and result.text() == ""
    last = _last(result)
    assert last.num_output_tokens == 12 and last.num_reasoning_tokens == 12


def test_separate_reasoning_false_keeps_the_raw_text(thinking_engine):
    params = dict(max_tokens=12, temperature=0.0)
    separate = _chat(thinking_engine, SamplingParams(**params))
    raw = _chat(thinking_engine, SamplingParams(**params, separate_reasoning=False))
    assert _reasoning(separate) and raw.text() == _reasoning(separate)  # the reasoning, in the text as written
    assert all(choice.reasoning is None for output in raw.outputs for choice in output.choices)
    assert _last(raw).num_reasoning_tokens == 0


def test_enable_thinking_false_leaves_nothing_to_parse(thinking_engine):
    result = _chat(thinking_engine, SamplingParams(max_tokens=6, temperature=0.0), enable_thinking=False)
    assert all(choice.reasoning is None for output in result.outputs for choice in output.choices)
    assert result.text() and _last(result).num_reasoning_tokens == 0


def test_structured_output_leaves_the_reasoning_free_and_constrains_the_answer(thinking_engine):
    constrained = SamplingParams(max_tokens=10, temperature=0.0, json_schema=json.dumps(SCHEMA))
    free = _chat(thinking_engine, SamplingParams(max_tokens=10, temperature=0.0))
    reasoning = _chat(thinking_engine, constrained)
    assert _reasoning(reasoning) == _reasoning(free) and reasoning.text() == ""
    # without thinking the constraint holds from the first token
    answer = _chat(thinking_engine, SamplingParams(max_tokens=16, temperature=0.0, json_schema=json.dumps(SCHEMA)),
                   enable_thinking=False)
    assert json.loads(answer.text())["city"] in ("Paris", "Rome")


# --- the output processor: reasoning first, then the answer's tool calls -------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_reasoning_comes_apart_before_the_answer_is_parsed_for_tool_calls():
    tokenizer = PieceTokenizer()
    processor = OutputProcessor(tokenizer, THINK_TAGS)
    processor.add_request("r", tokenizer.ids("Hi"), SamplingParams(max_tokens=50),
                          tool_spec(TOOLS, "auto", True), OPEN)
    pieces = ["I should ", "call <tool_call>?", " no: it", "</", "think", ">\n\n", "<tool_call>", '\n{"name": ',
              '"weather", "arguments": ', '{"city": "Paris"}', "}\n</tool_call>"]
    deltas = []
    for index, token_id in enumerate(tokenizer.ids(*pieces)):
        output, _ = processor.process(core_output("r", [token_id], "stop" if index == len(pieces) - 1 else None))
        deltas += output.choices if output is not None else []
    assert "".join(delta.reasoning for delta in deltas) == "I should call <tool_call>? no: it"
    assert "".join(delta.text for delta in deltas) == ""
    calls: list[dict] = []
    merge_tool_call_deltas(calls, [call for delta in deltas for call in delta.tool_calls])
    assert [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls] == \
        [("weather", {"city": "Paris"})]
    last = deltas[-1]
    assert (last.finish_reason, last.num_output_tokens, last.num_reasoning_tokens) == ("tool_calls", 11, 6)


def test_the_tool_call_grammar_applies_after_the_reasoning(ll_tokenizer):
    tokenizer, ll = ll_tokenizer
    grammar = after_reasoning(tool_call_lark(tool_spec(TOOLS, "required", False)), (THINK_TAGS, OPEN))
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    for text, accepted in [("free <tool_call> text</think>\n" + call, True), ("</think>" + call, True),
                           ("no call</think>Rome", False), (call, False)]:
        matcher = LLMatcher(ll, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        assert (matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()) is accepted, text
