"""xgrammar's structural tag `format` tree (SGLang's newer `{"type": "structural_tag", "format": {...}}`) as an
llguidance grammar.

Each format becomes a Lark expression: `const_string` a literal, `json_schema` an inline `%json`, `regex` a
regex lexeme, `grammar` (Lark or GBNF) a grammar of its own referenced as `@name`, `sequence` / `or`
concatenation / alternatives, `tag` begin content end, `tags_with_separator` a separated list. Free text is
where llguidance needs care, as its lexemes are greedy: text must stop at a literal, so `any_text` is a lazy
lexeme ending at the literal that follows it (a tag's end, the begin of the next tag) or the format's last
part, and `triggered_tags` is llguidance's lazy trigger lexemes (free text up to a trigger, which must then go
on as a tag whose begin starts with it), with `excludes` as regex negation. What cannot be said so (a
`qwen_xml_parameter` schema, JSON in another `style`, free text followed by something that is not a literal)
is refused, naming the field's path."""

from __future__ import annotations

import json

import llguidance
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from tritonllm.interface.errors import InvalidRequest

_ANY = r"/(.|\n)*/"
# A regex constraint's \d and \w are ASCII's ([0-9], [0-9a-zA-Z_]), as in ECMAScript, JSON Schema's patterns (which
# llguidance already reads so) and xgrammar, SGLang's and vLLM's default; llguidance's own regex reads them as
# Unicode's, and a sampled `\d{3}` once came out as three four-byte digits of U+1FBF0's block. \s stays Unicode's,
# as in ECMAScript.
_ASCII_CLASSES = "dw"
_FIELDS = {  # each format type's fields: required, optional
    "const_string": ({"value"}, set()),
    "json_schema": ({"json_schema"}, {"style"}),
    "grammar": ({"grammar"}, set()),
    "regex": ({"pattern"}, set()),
    "any_text": (set(), {"excludes"}),
    "sequence": ({"elements"}, set()),
    "or": ({"elements"}, set()),
    "tag": ({"begin", "content", "end"}, set()),
    "triggered_tags": ({"triggers", "tags"}, {"at_least_one", "stop_after_first", "excludes"}),
    "tags_with_separator": ({"tags", "separator"}, {"at_least_one", "stop_after_first"}),
}


def _fail(path: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"invalid structural_tag: {path} {message}", "structural_tag")


def structural_tag_format_grammar(tag: dict) -> str:
    """The `{"type": "structural_tag", "format": {...}}` object as a Lark grammar (or, when it holds `grammar`
    formats, llguidance's JSON of Lark grammars, the first one the start)."""
    extra = sorted(set(tag) - {"type", "format"})
    if extra:
        raise _fail(extra[0], "is not a field of the structural tag's format form (type and format)")
    builder = _LarkBuilder()
    start = builder.expression(tag["format"], "format", at_end=True)
    lark = "%llguidance {}\n" + f"start: {start}\n" + "".join(builder.rules)
    if not builder.side_grammars:
        return lark
    return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *builder.side_grammars]})


class _LarkBuilder:
    """Lark rules made while walking the format tree. `at_end`: nothing follows the part being built, so free
    text may run to the end; `skip_leading`: the literal the part starts with was already matched (by the free
    text before it, which stops at that literal)."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.side_grammars: list[dict] = []

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"part_{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}\n")
        return name

    def text(self, excludes, path: str) -> str:
        """A lexeme of any text, none of `excludes` in it (a token: llguidance negates only tokens)."""
        if not isinstance(excludes, list) or not all(isinstance(text, str) and text for text in excludes):
            raise _fail(path, "must be a list of non-empty strings")
        if not excludes:
            return _ANY
        banned = "|".join(llguidance.regex_to_lark(_regex_escape(text)) for text in excludes)
        name = f"TEXT_{len(self.rules)}"
        self.rules.append(f"{name}: {_ANY} & ~/(.|\\n)*({banned})(.|\\n)*/\n")
        return name

    def expression(self, fmt, path: str, at_end: bool, skip_leading: bool = False) -> str:
        kind = _checked(fmt, path)
        if kind == "const_string":
            return '""' if skip_leading else _literal(_string(fmt, "value", path))
        if kind == "json_schema":
            return self._json_schema(fmt, path)
        if kind == "regex":
            pattern = _string(fmt, "pattern", path)
            _valid(LLMatcher.grammar_from_regex(pattern), f"{path}.pattern", "regex")
            return f"/{regex_lark(pattern)}/"
        if kind == "grammar":
            return self._grammar(_string(fmt, "grammar", path), f"{path}.grammar")
        if kind == "any_text":
            if not at_end:
                raise _fail(path, "must end the format, be a tag's content or come right before a const_string or "
                                 "tag in a sequence: free text stops only at a literal")
            return self.text(fmt.get("excludes", []), f"{path}.excludes")
        if kind == "or":
            return "(" + " | ".join(self.expression(element, f"{path}.elements[{index}]", at_end)
                                    for index, element in enumerate(_elements(fmt, path))) + ")"
        if kind == "sequence":
            return self._sequence(fmt, path, at_end)
        if kind == "tag":
            return self._tag(fmt, path, at_end, skip_leading)
        if kind == "triggered_tags":
            return self._triggered_tags(fmt, path, at_end)
        return self._tags_with_separator(fmt, path)

    def _sequence(self, fmt: dict, path: str, at_end: bool) -> str:
        elements = _elements(fmt, path)
        parts, skip = [], False
        for index, element in enumerate(elements):
            element_path, last = f"{path}.elements[{index}]", index == len(elements) - 1
            stop = "" if last else _leading_literal(elements[index + 1])
            if stop and isinstance(element, dict) and element.get("type") == "any_text":
                _checked(element, element_path)
                # free text up to the next element's literal, at its first occurrence (a lazy lexeme that
                # matches the literal too: the next element goes on after it)
                text = self.text(element.get("excludes", []), f"{element_path}.excludes")
                parts.append(self.rule(f"{text} {_literal(stop)}", lazy=True))
                skip = True
                continue
            parts.append(self.expression(element, element_path, at_end and last, skip_leading=skip))
            skip = False
        return "(" + " ".join(parts) + ")"

    def _json_schema(self, fmt: dict, path: str) -> str:
        if fmt.get("style", "json") != "json":
            raise _fail(f"{path}.style", f"{fmt['style']!r} is not supported: only 'json' (llguidance has no XML "
                                        "form of a JSON schema)")
        schema = fmt["json_schema"]
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise _fail(f"{path}.json_schema", "must be a JSON schema object (or true)")
        return "%json " + json.dumps(schema)

    def _grammar(self, text: str, path: str) -> str:
        try:
            lark = any_to_lark(text)
        except Exception as error:  # the converter raises plain exceptions on bad GBNF
            raise _fail(path, f"is not a valid Lark or GBNF grammar: {error}") from None
        _valid(LLMatcher.grammar_from_lark(lark), path, "Lark or GBNF grammar")
        name = f"grammar_{len(self.side_grammars)}"
        self.side_grammars.append({"name": name, "lark_grammar": lark})
        return f"@{name}"

    def _tag(self, fmt: dict, path: str, at_end: bool, skip_begin: bool = False) -> str:
        begin = "" if skip_begin else _literal(_string(fmt, "begin", path)) + " "
        ends = fmt["end"] if isinstance(fmt["end"], list) else [fmt["end"]]
        if not ends or not all(isinstance(end, str) for end in ends):
            raise _fail(f"{path}.end", "must be a string or a non-empty list of strings")
        end = "(" + " | ".join(_literal(end) for end in ends) + ")"
        content, content_path = fmt["content"], f"{path}.content"
        if _checked(content, content_path) == "any_text" and all(ends):
            # text up to the (first) end: one lazy lexeme ending at it
            text = self.text(content.get("excludes", []), f"{content_path}.excludes")
            return begin + self.rule(f"{text} {end}", lazy=True)
        at_content_end = at_end and ends == [""]
        return f"{begin}{self.expression(content, content_path, at_content_end)} {end}"

    def _tags(self, fmt: dict, path: str) -> list[tuple[str, dict]]:
        tags = fmt["tags"]
        if not isinstance(tags, list) or not tags:
            raise _fail(f"{path}.tags", "must be a non-empty list of tag formats")
        for index, tag in enumerate(tags):
            if _checked(tag, f"{path}.tags[{index}]") != "tag":
                raise _fail(f"{path}.tags[{index}].type", "must be 'tag'")
            _string(tag, "begin", f"{path}.tags[{index}]")
        return [(f"{path}.tags[{index}]", tag) for index, tag in enumerate(tags)]

    def _triggered_tags(self, fmt: dict, path: str, at_end: bool) -> str:
        triggers = fmt["triggers"]
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise _fail(f"{path}.triggers", "must be a non-empty list of non-empty strings")
        at_least_one, stop_after_first = _flag(fmt, "at_least_one", path), _flag(fmt, "stop_after_first", path)
        text = self.text(fmt.get("excludes", []), f"{path}.excludes")
        alternatives = []
        for tag_path, tag in self._tags(fmt, path):
            starts = [trigger for trigger in triggers if tag["begin"].startswith(trigger)]
            if not starts:
                raise _fail(f"{tag_path}.begin", f"{tag['begin']!r} starts with none of the triggers")
            trigger = max(starts, key=len)
            # free text, then the trigger at its first occurrence (a lazy lexeme: a trigger in the text must
            # open a tag); the rest of the tag's begin, its content and end follow
            opener = self.rule(f"{text} {_literal(trigger)}", lazy=True)
            alternatives.append(f"{opener} {_literal(tag['begin'][len(trigger):])} "
                                f"{self._tag(tag, tag_path, at_end=False, skip_begin=True)}")
        one = self.rule(" | ".join(alternatives))
        if stop_after_first and at_least_one:
            return one
        if not at_end:
            raise _fail(path, "must end the format (free text follows its tags), unless stop_after_first and "
                             "at_least_one are both true")
        if stop_after_first:
            return f"({one} | {text})"
        return f"({one}{'+' if at_least_one else '*'} {text})"

    def _tags_with_separator(self, fmt: dict, path: str) -> str:
        separator = _string(fmt, "separator", path)
        at_least_one, stop_after_first = _flag(fmt, "at_least_one", path), _flag(fmt, "stop_after_first", path)
        one = self.rule(" | ".join(self._tag(tag, tag_path, at_end=False) for tag_path, tag in self._tags(fmt, path)))
        if stop_after_first:
            return one if at_least_one else f"{one}?"
        listed = f"{one} ({_literal(separator)} {one})*"
        return f"({listed})" if at_least_one else f"({listed})?"


def _elements(fmt: dict, path: str) -> list:
    if not isinstance(fmt["elements"], list) or not fmt["elements"]:
        raise _fail(f"{path}.elements", "must be a non-empty list of formats")
    return fmt["elements"]


def _checked(fmt, path: str) -> str:
    """The format's type, once its fields are those of the type."""
    if not isinstance(fmt, dict):
        raise _fail(path, "must be a format object with a type")
    kind = fmt.get("type")
    if kind not in _FIELDS:
        supported = ", ".join(_FIELDS)
        raise _fail(f"{path}.type", f"{kind!r} is not supported (supported: {supported})")
    required, optional = _FIELDS[kind]
    missing = sorted(required - set(fmt))
    if missing:
        raise _fail(f"{path}.{missing[0]}", f"is required for a {kind} format")
    extra = sorted(set(fmt) - required - optional - {"type"})
    if extra:
        raise _fail(f"{path}.{extra[0]}", f"is not a field of a {kind} format")
    return kind


def _leading_literal(fmt) -> str:
    """The literal a format starts with ("" when it starts otherwise), for free text before it to stop at."""
    if isinstance(fmt, dict) and fmt.get("type") == "const_string" and isinstance(fmt.get("value"), str):
        return fmt["value"]
    if isinstance(fmt, dict) and fmt.get("type") == "tag" and isinstance(fmt.get("begin"), str):
        return fmt["begin"]
    return ""


def _valid(grammar: str, path: str, what: str) -> None:
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise _fail(path, f"is not a valid {what}: {error}")


def regex_lark(pattern: str) -> str:
    """A regex constraint's pattern in llguidance's Lark regex syntax, its classes as `_ASCII_CLASSES` says."""
    return llguidance.regex_to_lark(pattern, _ASCII_CLASSES)


def _regex_escape(text: str) -> str:
    """`text` as a regex of itself (Rust's regex syntax: only its meta characters may be escaped)."""
    return "".join("\\" + char if char in "\\.+*?()|[]{}^$#&-~" else char for char in text)


def _literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a Lark string


def _string(fmt: dict, field: str, path: str) -> str:
    if not isinstance(fmt[field], str):
        raise _fail(f"{path}.{field}", "must be a string")
    return fmt[field]


def _flag(fmt: dict, field: str, path: str) -> bool:
    value = fmt.get(field, False)
    if not isinstance(value, bool):
        raise _fail(f"{path}.{field}", "must be true or false")
    return value
