"""Tool calls in the Hermes convention: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`.

`tool_call_lark` is the grammar that makes every call parse and validate: with `required` (or a named function)
the whole answer is calls, with `auto` free text until the model writes `<tool_call>` (llguidance's lazy trigger,
as structural tags), and from there a call; each call's arguments are JSON of that function's parameters schema.
`ToolCallParser` turns a choice's text, as it streams, into content and OpenAI's tool-call deltas (the call's id
and name first, then fragments of its arguments): the one parser for both the Triton and the OpenAI surface."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

from tritonllm.interface.tools import NO_PARAMETERS, ToolSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_TAIL = "}\n" + CALL_CLOSE  # after the arguments: the call object's own brace
HERMES_TEMPLATE = (Path(__file__).parent / "templates" / "hermes_tools.jinja").read_text()
"""The chat template for models whose own renders no tools."""
# Arguments as the Hermes prompt shows them and templates render them (tojson): ", " and ": ", no free whitespace
# (a small model given free whitespace may spend its token budget on blank lines).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# (the arguments' first character must have come: whitespace before it is not theirs)
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def lark_string(text: str) -> str:
    return json.dumps(text)


def tool_call_lark(spec: ToolSpec) -> str:
    """The Lark grammar of an answer to a request whose tool_choice is not none."""
    bodies = []
    for index, function in enumerate(spec.callable_functions()):
        schema = {**(function.get("parameters") or NO_PARAMETERS), "x-guidance": _JSON_OPTIONS}
        head = lark_string(f'\n{{"name": "{function["name"]}", "arguments": ')
        bodies.append(f"body_{index}: {head} %json {json.dumps(schema)} {lark_string(CALL_TAIL)}")
    more = ' ("\\n" call)*' if spec.parallel and spec.choice in ("auto", "required") else ""
    if spec.choice == "auto":  # free text, or free text up to the trigger and then calls
        start = ["start: text | trigger body" + more, "text: TEXT", "TEXT: /(.|\\n)*/",
                 f"trigger[lazy]: TEXT {lark_string(CALL_OPEN)}"]
    else:
        start = ["start: call" + more]
    rules = start + [f"call: {lark_string(CALL_OPEN)} body",
                     "body: " + " | ".join(f"body_{index}" for index in range(len(bodies)))] + bodies
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def held_back(text: str, marker: str) -> int:
    """The length of text's longest suffix that is a proper prefix of marker (it may become the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolCallParser:
    """One choice's text → (content, tool-call deltas), fed piece by piece. Markup never reaches the content;
    text outside calls after the first call is kept only when it is more than whitespace (calls are separated by
    newlines). A call's arguments end where their JSON value does (a string in them may hold `</tool_call>`)."""

    def __init__(self):
        self._pending = ""  # text not yet turned into content or deltas
        self._in_call = False
        self._named = False  # the open call's id and name have gone out
        self._arguments = _JsonScanner()  # where the open call's arguments end
        self.calls = 0  # calls opened so far (each one's index)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The content and OpenAI tool-call deltas that text adds; `final`: the choice has ended (nothing is held
        back: an unfinished call's arguments go out as they are)."""
        self._pending += text
        content, deltas = [], []
        while True:
            if not self._in_call:
                start = self._pending.find(CALL_OPEN)
                end = start if start >= 0 else len(self._pending) - (0 if final else
                                                                     held_back(self._pending, CALL_OPEN))
                outside, self._pending = self._pending[:end], self._pending[end:]
                if self.calls == 0 or outside.strip():
                    content.append(outside)
                if start < 0:
                    break
                self._pending = self._pending[len(CALL_OPEN):]
                self._in_call, self._named = True, False
            elif not self._named:
                head = _CALL_HEAD.match(self._pending)
                if head is None:
                    if final:  # not a call after all (unconstrained text): it stays content
                        content.append(CALL_OPEN + self._pending)
                        self._pending, self._in_call = "", False
                    break
                self._pending = self._pending[head.end():]
                deltas.append({"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": json.loads(head.group(1)), "arguments": ""}})
                self._named = True
            else:
                if not self._arguments.done:  # the arguments go out as they come, up to their own end
                    end = self._arguments.scan(self._pending)
                    arguments, self._pending = self._pending[:end], self._pending[end:]
                    if arguments:
                        deltas.append({"index": self.calls, "function": {"arguments": arguments}})
                    if not self._arguments.done:
                        break
                close = self._pending.find(CALL_CLOSE)  # (after the call object's own "}")
                if close < 0:
                    break
                self._pending = self._pending[close + len(CALL_CLOSE):]
                self._in_call, self._arguments = False, _JsonScanner()
                self.calls += 1
        if final and self._in_call and self._named:
            self.calls += 1  # an unfinished call (max_tokens) still went out
        return "".join(content), deltas


class _JsonScanner:
    """Finds where a JSON value that starts with an object or array ends (strings may hold any brace or markup),
    fed the text in pieces."""

    def __init__(self):
        self._depth = 0
        self._in_string = self._escaped = False
        self.done = False

    def scan(self, text: str) -> int:
        """How much of text belongs to the value (all of it while it has not ended)."""
        for position, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.done = True
                    return position + 1
        return len(text)


def merge_tool_call_deltas(calls: list[dict], deltas: list[dict]) -> None:
    """Fold streamed deltas into whole calls (OpenAI's message.tool_calls), in place."""
    for delta in deltas:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": delta["type"], "function": dict(delta["function"])})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
