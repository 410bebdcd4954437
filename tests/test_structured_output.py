"""Constrained decoding in the engine: grammars from llguidance masking the logits, off-thread compilation with a
cache, grammar completion as a stop, EOS only where the grammar accepts, and no effect on unconstrained requests."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import regex
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core import structured_output
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import Request
from tritonllm.interface.errors import InvalidRequest
from engine_helpers import EXACT, assert_idle, generate

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PROMPTS = ["The capital of France is", "My phone number is", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(default_model_dir), **EXACT, kv_cache_memory=64 << 20,
                                  max_num_batched_tokens=64))


def test_regex_output_fullmatches_and_stops_when_complete(engine):
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=5, n=3, regex=PHONE)
    [result] = generate(engine, ["Call me at"], params)
    for index in range(3):
        assert regex.fullmatch(PHONE, result.text(index)), result.text(index)
        # the grammar ended it, not the length limit (the phone number is 10 to 14 tokens)
        assert result.finish_reason(index) == "stop"
    assert_idle(engine)


@pytest.mark.parametrize("name, text, quote", [
    ("regex", r"\d\d\w", ""),
    ("json_schema", json.dumps({"type": "string", "pattern": r"^\d\d\w$"}), '"'),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": r"\d\d\w"}}), "")])
def test_digit_and_word_classes_are_ascii_in_every_constraint(engine, name, text, quote):
    """\\d and \\w are [0-9] and [0-9a-zA-Z_] (ECMAScript's, JSON Schema's, xgrammar's) in a regex as in a schema's
    pattern: Unicode's digits and letters are refused (llguidance's own regex took them)."""
    initial = engine.parts.grammars.compile(name, text).result(timeout=60)

    def accepts(value: str) -> bool:
        matcher = initial.deep_copy()
        tokens = engine.tokenizer.encode(quote + value + quote, add_special_tokens=False)
        return matcher.consume_tokens(tokens) and matcher.is_accepting()

    assert accepts("42a") and accepts("07_")
    assert not accepts("\u0664\u0662a") and not accepts("42\u00e9") and not accepts("\U0001fbf4\U0001fbf2a")


def test_eos_only_where_the_grammar_accepts(engine):
    """A +100 bias on EOS cannot end the text before the grammar accepts; at the first token where it does, EOS
    ends it."""
    eos = min(engine.core.eos_token_ids)
    params = SamplingParams(max_tokens=30, temperature=0, regex=r"[a-z]{5,8}", logit_bias={eos: 100.0})
    [result] = generate(engine, ["A word:"], params)
    assert regex.fullmatch(r"[a-z]{5,8}", result.text()), result.text()
    assert result.token_ids()[-1] == eos and result.finish_reason() == "stop"
    assert len(engine.tokenizer.decode(result.token_ids()[:-2])) < 5


def test_max_tokens_cuts_a_valid_prefix(engine):
    schema = json.dumps({"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]})
    [result] = generate(engine, ["A JSON story:"], SamplingParams(max_tokens=6, temperature=0, json_schema=schema))
    assert result.finish_reason() == "length" and len(result.token_ids()) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text())
    fresh = engine.parts.grammars.compile("json_schema", schema).result().deep_copy()
    assert fresh.consume_tokens(result.token_ids()) and not fresh.is_accepting()


def test_json_schema_with_n_seed_stop_and_logprobs(engine):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**7}},
              "required": ["city", "population"], "additionalProperties": False}
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=11, n=2, logprobs=2, json_schema=json.dumps(schema))
    first = generate(engine, ["A city as JSON:"], params)[0]
    again = generate(engine, ["A city as JSON:"], params)[0]
    for index in range(2):
        value = json.loads(first.text(index))
        assert set(value) == {"city", "population"} and len(value["city"]) <= 12
        assert first.text(index) == again.text(index)  # seeded: reproducible
        logprobs = [entry for output in first.outputs for choice in output.choices if choice.index == index
                    for entry in choice.logprobs]
        assert len(logprobs) == len(first.token_ids(index)) and all(len(e.top) == 2 for e in logprobs)
    stopped = generate(engine, ["A city as JSON:"], SamplingParams(
        max_tokens=60, temperature=0, json_schema=json.dumps(schema), stop=[","]))[0]
    assert stopped.finish_reason() == "stop" and "," not in stopped.text()
    assert stopped.outputs[-1].choices[-1].matched_stop == ","


def test_unconstrained_requests_are_token_exact_beside_constrained_ones(engine):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [result.token_ids() for result in generate(engine, PROMPTS, greedy)]
    constrained = [SamplingParams(max_tokens=24, temperature=0.7, seed=i, regex=PHONE if i % 2 else r"[A-Z][a-z ]+\.")
                   for i in range(4)]
    mixed = generate(engine, [p for pair in zip(PROMPTS, PROMPTS) for p in pair],
                     [p for pair in zip([greedy] * 4, constrained) for p in pair])
    assert [result.token_ids() for result in mixed[0::2]] == alone
    assert_idle(engine)


@pytest.mark.parametrize("name, text, message", [
    ("regex", "[0-9", "unclosed character class"),
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("json_schema", "{not json", "invalid json_schema"),
    ("ebnf", "root ::= (", "invalid ebnf"),
    ("ebnf", "start: undefined_rule", "undefined_rule"),
])
def test_invalid_grammar_fails_its_request_alone(engine, name, text, message):
    good = SamplingParams(max_tokens=8, temperature=0)
    bad = SamplingParams(max_tokens=8, **{name: text})
    ok, failed = generate(engine, PROMPTS[:2], [good, bad])
    assert ok.finish_reason() == "length" and ok.outputs[-1].error is None
    error = failed.outputs[-1].error
    assert isinstance(error, InvalidRequest) and error.param == name and message in str(error)
    assert_idle(engine)


def test_two_constraints_are_refused():
    with pytest.raises(InvalidRequest, match="only one constraint") as raised:
        SamplingParams.from_dict({"regex": "a", "ebnf": "start: \"a\""})
    assert raised.value.param == "ebnf"


def test_a_repeated_grammar_is_compiled_once(engine):
    compiled = []
    original = engine.parts.grammars._build

    def counting(name, text, reasoning):
        compiled.append(text)
        return original(name, text, reasoning)

    engine.parts.grammars._build = counting
    try:
        grammar = r"(yes|no|maybe)"
        results = generate(engine, PROMPTS, SamplingParams(max_tokens=5, temperature=0.9, regex=grammar))
        results += generate(engine, PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0.9, regex=grammar))
    finally:
        engine.parts.grammars._build = original
    assert compiled == [grammar]
    assert all(regex.fullmatch(grammar, result.text()) for result in results)


def test_a_slow_compile_does_not_stall_other_requests(engine):
    """While one grammar compiles (held here), an unconstrained request runs to its end; the constrained one then
    starts and finishes."""
    release = threading.Event()
    original = engine.parts.grammars._build

    def slow(name, text, reasoning):
        assert release.wait(30)
        return original(name, text, reasoning)

    engine.parts.grammars._build = slow
    try:
        engine.add_request(Request("slow-grammar", "Say yes:", SamplingParams(max_tokens=5, regex="(yes|no)!")))
        engine.add_request(Request("plain", "Hello", SamplingParams(max_tokens=6, temperature=0)))
        finished = {}
        deadline = time.monotonic() + 60
        while "plain" not in finished:
            assert time.monotonic() < deadline
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "slow-grammar" not in finished and engine.core.num_waiting_requests() == 1
        release.set()
        while "slow-grammar" not in finished:
            assert time.monotonic() < deadline
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        release.set()
        engine.parts.grammars._build = original
    assert finished["slow-grammar"].error is None
    assert_idle(engine)


def test_aborting_a_request_while_its_grammar_compiles(engine):
    release = threading.Event()
    original = engine.parts.grammars._build
    engine.parts.grammars._build = lambda name, text, reasoning: release.wait(30) and original(name, text, reasoning)
    try:
        engine.add_request(Request("abandoned", "Hi", SamplingParams(max_tokens=5, regex="(a|b)c")))
        engine.abort_request("abandoned")
        [output] = engine.step()
        assert output.finished and output.choices[0].finish_reason == "abort"
    finally:
        release.set()
        engine.parts.grammars._build = original
    assert_idle(engine)


def test_bitmask_marks_exactly_the_tokens_the_matcher_allows(engine):
    """At every state of a regex, from the start to a complete match, the filler's row holds exactly the tokens
    llguidance's own mask allows, and exactly the tokens whose text keeps the output a prefix of a match (EOS once it
    is a match), found by brute force over the vocabulary; unconstrained rows allow everything; a request's
    allowed_token_ids narrow its grammar's."""
    pattern = regex.compile(r"[0-9]{1,3}-[a-z]+")  # states with allowed sets of 1 to thousands of tokens
    tokenizer, vocab_size = engine.tokenizer, engine.vocab_size

    def row(grammar=None, allowed_token_ids=()):  # what fill reads of a sequence
        allowed = structured_output.allowed_tokens_bitmask(list(allowed_token_ids), vocab_size) \
            if allowed_token_ids else None
        return SimpleNamespace(grammar=grammar, request=SimpleNamespace(allowed_tokens=allowed))

    def allowed_of(words: torch.Tensor) -> list[int]:
        bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
        return bits.nonzero().flatten().tolist()

    texts = [tokenizer.decode([t]) for t in range(vocab_size)]

    def continuing(output: str) -> list[int]:
        """Every token after which the output can still become a match (partial=True), EOS when it is one."""
        allowed = {t for t, text in enumerate(texts) if pattern.fullmatch(output + text, partial=True)}
        return sorted(allowed | engine.core.eos_token_ids if pattern.fullmatch(output) else allowed)

    compiled = engine.parts.grammars.compile("regex", pattern.pattern).result()
    match = tokenizer.encode("123-ab")
    sizes = []
    for consumed in range(len(match) + 1):
        matcher = compiled.deep_copy()
        assert matcher.consume_tokens(match[:consumed])
        unconstrained, constrained = engine.core.sampler.bitmasks.fill([row(), row(matcher)])
        assert bool((unconstrained == -1).all())
        allowed = allowed_of(constrained)
        assert allowed == allowed_of(torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32))
        assert allowed == continuing(tokenizer.decode(match[:consumed]))
        sizes.append(len(allowed))
    # the states differ: the ten digits, then also "-", then "-" alone, then thousands of letter tokens, then also EOS
    assert sizes[:4] == [10, 11, 11, 1] and sizes[4] > 1000 and sizes[5] == sizes[4] + 1, sizes

    seven, letter = tokenizer.convert_tokens_to_ids("7"), tokenizer.convert_tokens_to_ids("a")
    narrowed = engine.core.sampler.bitmasks.fill([row(compiled.deep_copy(), [seven, letter]), row(None, [letter])])
    assert narrowed.shape == (2, structured_output.bitmask_words(vocab_size))
    assert allowed_of(narrowed[0]) == [seven] and allowed_of(narrowed[1]) == [letter]
