"""Compiling constraints (`json_schema`, `regex`, `ebnf`, `structural_tag`) into llguidance matchers, off the engine
core's thread.

A small thread pool compiles each constraint into a matcher in its initial state; a bounded cache keyed by the
grammar text means a repeated schema is compiled once, and requests that arrive while it compiles share that one
compile. The core waits for the future and gives each sequence its own copy (engine/structured_output.py)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
from llguidance import LLMatcher

from tritonllm.interface.errors import InvalidRequest
from tritonllm.engine.processing.reasoning import ANSWER_GRAMMAR, ReasoningStart, ReasoningTags, reasoning_lark
from tritonllm.engine.processing.structural_tag_format import regex_lark, structural_tag_format_grammar

log = logging.getLogger(__name__)

# llguidance's grammar formats for the other text constraints (json_schema and regex compile with options of
# their own). "grammar" takes Lark or GBNF syntax; "tools" is the Lark grammar of a request's tool calls
# (tool_calls.py).
_FORMATS = {"ebnf": "grammar", "tools": "grammar"}
# Compact JSON (", " and ": " separators, no free whitespace): a small model given free whitespace may spend its
# token budget on blank lines.
_JSON_OPTIONS = {"whitespace_flexible": False}


def structural_tag_lark(text: str) -> str:
    """SGLang's structural tag as a Lark grammar. Its `structures` (begin, schema, end) and `triggers` are
    llguidance's structural tags: free text in which a trigger (text, even when it looks like a special token)
    must go on as a structure whose begin starts with it, then JSON of its schema, then its end (this form's
    `at_least_one` is refused). xgrammar's newer `format` tree: structural_tag_format.py."""
    def fail(message: str) -> InvalidRequest:
        return InvalidRequest(f"invalid structural_tag: {message}", "structural_tag")

    try:
        tag = json.loads(text)
    except json.JSONDecodeError as error:
        raise fail(f"not valid JSON: {error}") from None
    if not isinstance(tag, dict):
        raise fail("it must be an object with structures and triggers")
    if "format" in tag:  # xgrammar's newer form
        return structural_tag_format_grammar(tag)
    if tag.get("at_least_one"):
        raise fail("at_least_one is not supported")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise fail("triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise fail("structures must be a non-empty list of {begin, schema, end} objects")
    tags = []
    for index, structure in enumerate(structures):
        if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str) \
                or not isinstance(structure.get("end"), str) or not isinstance(structure.get("schema") or {}, dict):
            raise fail(f"structures[{index}] must be an object with a string begin and end and a schema object")
        starts = [trigger for trigger in triggers if structure["begin"].startswith(trigger)]
        if not starts:
            raise fail(f"structures[{index}].begin {structure['begin']!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=max(starts, key=len), begin=structure["begin"],
                                         grammar=structure.get("schema") or {}, end=structure["end"]))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


AfterReasoning = tuple[ReasoningTags, ReasoningStart]
"""A constraint on the answer of a reasoning model: its tags, and where its output starts."""


def after_reasoning(grammar: str, reasoning: AfterReasoning) -> str:
    """llguidance's grammar (a top-level JSON object or Lark text) as the answer after free reasoning."""
    grammars = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    answer = {**grammars[0], "name": ANSWER_GRAMMAR}
    return json.dumps({"grammars": [{"lark_grammar": reasoning_lark(*reasoning)}, answer, *grammars[1:]]})


class GrammarCompiler:
    """Compiles constraints into matchers on worker threads, with an LRU cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], cache_size: int = 256,
                 workers: int = 2):
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on first use (about a second): unconstrained servers never pay for it
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tritonllm-grammar")
        self._cache: OrderedDict[tuple[str, str, AfterReasoning | None], Future] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()

    def compile(self, name: str, text: str, reasoning: AfterReasoning | None = None) -> Future:
        """A future of the constraint's matcher in its initial state (copy it before use); it fails with
        InvalidRequest naming `name` when the grammar is invalid. With `reasoning`, the constraint applies to the
        answer after the (free) reasoning."""
        key = (name, text, reasoning)
        with self._cache_lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._build, name, text, reasoning)
                self._cache[key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                try:
                    # n_vocab: masks must cover every logit, including padding entries the tokenizer lacks
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids)
                except ValueError as error:  # e.g. a slow (Python) tokenizer
                    raise InvalidRequest(f"this model's tokenizer cannot be used for constrained decoding: {error}")
            return self._ll_tokenizer

    def _build(self, name: str, text: str, reasoning: AfterReasoning | None) -> LLMatcher:
        started = time.perf_counter()
        try:
            if name == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
            elif name == "structural_tag":
                grammar = LLMatcher.grammar_from_lark(structural_tag_lark(text))
            elif name == "regex":
                grammar = llguidance.grammar_from("regex", regex_lark(text))
            else:
                grammar = llguidance.grammar_from(_FORMATS[name], text)
            if reasoning is not None:
                grammar = after_reasoning(grammar, reasoning)
        except ValueError as error:
            raise InvalidRequest(f"invalid {name}: {error}", param=name) from None
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"invalid {name}: {matcher.get_error()}", param=name)
        log.info("compiled a %s constraint (%d chars) in %.1f ms", name, len(text),
                 (time.perf_counter() - started) * 1e3)
        return matcher
