"""Reasoning kept apart from the answer, for models that think in tags (`<think>…</think>`: Qwen3, DeepSeek-R1).

A model family declares its tags here (`REASONING_PARSERS`, vLLM's `--reasoning-parser` names); the engine's
`reasoning_parser` setting picks one, or `auto` the one whose tags the chat template writes. Only chat prompts are
parsed. Where the answer starts is read off the end of the rendered prompt (`reasoning_start`): a prompt whose
last tag opens a reasoning (DeepSeek-R1's generation prompt, Qwen3-2507-thinking's) makes the output reasoning up
to the end tag; one whose last tag closes it (Qwen3 with `enable_thinking: false`) leaves nothing to parse;
otherwise the output may open a reasoning at its very start (Qwen3). `ReasoningParser` splits a choice's text, as
it streams, into reasoning and answer (the same split whatever the pieces); `reasoning_lark` is the grammar that
puts a constraint (structured output, tool calls) after the reasoning, which stays free, as vLLM does."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tritonllm.engine.processing.tool_calls import held_back, lark_string


@dataclass(frozen=True)
class ReasoningTags:
    start: str
    end: str


THINK_TAGS = ReasoningTags("<think>", "</think>")
REASONING_PARSERS = {"qwen3": THINK_TAGS, "deepseek_r1": THINK_TAGS}
"""Model family → the tags its models reason in."""
AUTO, NONE = "auto", "none"  # the other values of the reasoning_parser setting


class ReasoningStart(Enum):
    OPEN = "open"
    """The prompt opened the reasoning: the output is reasoning up to the end tag."""
    AT_START = "at_start"
    """The output may open a reasoning with the start tag, at its very start; else it is all answer."""


def reasoning_tags(setting: str, chat_template: str | None) -> ReasoningTags | None:
    """The tags of the served model's reasoning (None: it is not parsed). ValueError for an unknown name."""
    if setting == NONE:
        return None
    if setting == AUTO:
        return next((tags for tags in REASONING_PARSERS.values()
                     if chat_template and tags.start in chat_template and tags.end in chat_template), None)
    if setting not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning_parser {setting!r}: {AUTO}, {NONE} or one of "
                         f"{', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[setting]


def reasoning_start(tags: ReasoningTags, prompt_end: str) -> ReasoningStart | None:
    """Where the output stands, from the end of the rendered prompt (what follows the last message's content, or
    with it when the final message is continued); None: the reasoning is over (or skipped)."""
    opened, closed = prompt_end.rfind(tags.start), prompt_end.rfind(tags.end)
    if opened > closed:
        return ReasoningStart.OPEN
    return None if closed >= 0 else ReasoningStart.AT_START


ANSWER_GRAMMAR = "answer"
"""The name the constraint's own grammar has beside `reasoning_lark`'s (llguidance's `@name` reference)."""


def reasoning_lark(tags: ReasoningTags, start: ReasoningStart) -> str:
    """The Lark grammar of an output whose answer is constrained (by the grammar named ANSWER_GRAMMAR): free
    reasoning up to the end tag (opened by the prompt, or at the output's start, or not at all), the whitespace
    the answer starts after (ReasoningParser drops it), then the answer."""
    rules = ["%llguidance {}", f"reasoning[lazy]: TEXT {lark_string(tags.end)}", "TEXT: /(.|\\n)*/",
             "GAP: /[ \\t\\r\\n]+/"]
    if start is ReasoningStart.OPEN:
        rules.insert(1, f"start: reasoning GAP? @{ANSWER_GRAMMAR}")
    else:
        rules.insert(1, f"start: ({lark_string(tags.start)} reasoning GAP?)? @{ANSWER_GRAMMAR}")
    return "\n".join(rules) + "\n"


class _State(Enum):
    UNDECIDED = 1  # AT_START: the output may still open a reasoning
    REASONING = 2
    GAP = 3  # after the end tag: the whitespace before the answer is dropped
    ANSWER = 4


class ReasoningParser:
    """One choice's text → (reasoning, answer), fed piece by piece. The tags never reach either part; the
    whitespace between the end tag and the answer is dropped (a constraint's answer then is exactly what it
    allows). `reasoning_end`: how many characters of the text fed the reasoning took, its end tag included (None
    while it has not ended)."""

    def __init__(self, tags: ReasoningTags, start: ReasoningStart):
        self._tags = tags
        self._state = _State.REASONING if start is ReasoningStart.OPEN else _State.UNDECIDED
        self._pending = ""
        self._fed = 0  # characters fed so far
        self.reasoning_end: int | None = None

    @property
    def reasoning(self) -> bool:
        """Whether the text so far is still (or may still be) reasoning."""
        return self._state is _State.REASONING

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the answer text adds; `final`: the choice has ended (nothing is held back)."""
        self._fed += len(text)
        self._pending += text
        reasoning = answer = ""
        if self._state is _State.UNDECIDED:
            if not final and self._tags.start.startswith(self._pending):
                return "", ""  # it may still become the start tag
            if self._pending.startswith(self._tags.start):
                self._pending = self._pending[len(self._tags.start):]
                self._state = _State.REASONING
            else:
                self._state = _State.ANSWER
        if self._state is _State.REASONING:
            end = self._pending.find(self._tags.end)
            if end < 0:
                keep = 0 if final else held_back(self._pending, self._tags.end)
                reasoning = self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return reasoning, ""
            reasoning = self._pending[:end]
            self._pending = self._pending[end + len(self._tags.end):]
            self.reasoning_end = self._fed - len(self._pending)
            self._state = _State.GAP
        if self._state is _State.GAP:
            self._pending = self._pending.lstrip()
            if self._pending:
                self._state = _State.ANSWER
        if self._state is _State.ANSWER:
            answer, self._pending = self._pending, ""
        return reasoning, answer
