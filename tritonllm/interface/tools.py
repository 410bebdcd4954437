"""Tool calling's request rules, shared by the adapter and the engine (torch-free): what `tools`, `tool_choice`,
`parallel_tool_calls` and the chat messages that carry tool calls and their results may hold (OpenAI's shapes,
checked as vLLM checks them). Every failure is an InvalidRequest naming the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tritonllm.interface.errors import InvalidRequest

TOOL_CHOICES = ("none", "auto", "required")
"""tool_choice's words; a named function is {"type": "function", "function": {"name": ...}}."""
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""A function without `parameters` takes none (OpenAI: "an empty parameter list")."""


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and how the model may call them."""

    tools: list[dict]  # [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    choice: str  # "none", "auto", "required", or the name of the one function to call
    parallel: bool = True  # more than one call per answer (required, auto)

    @property
    def constrained(self) -> bool:
        """Whether calls are made (and so constrained and parsed): every choice but none."""
        return self.choice != "none"

    def callable_functions(self) -> list[dict]:
        """The functions the answer may call: all of them, or the named one."""
        functions = [tool["function"] for tool in self.tools]
        if self.choice in TOOL_CHOICES:
            return functions
        return [function for function in functions if function["name"] == self.choice]


def parse_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a non-empty list of function tools with unique valid names."""
    def fail(message: str) -> InvalidRequest:
        return InvalidRequest(message, "tools")

    if not isinstance(tools, list) or not tools:
        raise fail("tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise fail(f"{where} must be an object with type \"function\" and a function object")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise fail(f"{where} has unknown field {unknown[0]!r}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise fail(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes")
        if name in names:
            raise fail(f"{where}.function.name {name!r} is not unique")
        names.add(name)
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise fail(f"{where}.function has unknown field {unknown[0]!r}")
        if not isinstance(function.get("description", ""), str):
            raise fail(f"{where}.function.description must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise fail(f"{where}.function.parameters must be a JSON schema object")
    return tools


def parse_tool_choice(tool_choice, tools: list[dict] | None) -> str:
    """The choice's word, or the named function's name (which must be one of the tools). Absent: auto with
    tools, none without (OpenAI's defaults)."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InvalidRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        choice = tool_choice["function"]["name"]
    else:
        raise InvalidRequest("tool_choice must be one of none, auto, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice != "none" and not tools:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice not in TOOL_CHOICES and choice not in {tool["function"]["name"] for tool in tools}:
        raise InvalidRequest(f"tool_choice names the function {choice!r}, which is not among the tools",
                             "tool_choice")
    return choice


def tool_spec(tools, tool_choice, parallel_tool_calls: bool | None) -> ToolSpec | None:
    """A request's ToolSpec; None when it has no tools (then tool_choice may only be none)."""
    if tools is not None:
        tools = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, tools)
    if tools is None:
        return None
    return ToolSpec(tools, choice, parallel_tool_calls is not False)


def template_message(message: dict, index: int, text) -> dict:
    """A chat message as the chat template gets it: role and content (`text` turns content into a string), an
    assistant's `tool_calls` with their arguments as objects (templates render them with tojson, as vLLM hands
    them over), a tool result's `tool_call_id`. ValueError naming what is wrong."""
    where = f"messages[{index}]"
    role = message["role"]
    tool_calls = message.get("tool_calls")
    content = message.get("content")
    if content is None and not (role == "assistant" and tool_calls):
        raise ValueError(f"{where} needs a content (only an assistant message with tool_calls may leave it out)")
    try:
        rendered = {"role": role, "content": "" if content is None else text(content)}
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if tool_calls is not None:
        if role != "assistant":
            raise ValueError(f"{where}: only assistant messages have tool_calls")
        rendered["tool_calls"] = [_template_tool_call(call, f"{where}.tool_calls[{i}]")
                                  for i, call in enumerate(_list(tool_calls, f"{where}.tool_calls"))]
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str) or not message["tool_call_id"]:
            raise ValueError(f"{where}: a tool message needs the tool_call_id of the call it answers")
        rendered["tool_call_id"] = message["tool_call_id"]
    elif message.get("tool_call_id") is not None:
        raise ValueError(f"{where}: only tool messages have a tool_call_id")
    return rendered


def _list(value, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list")
    return value


def _template_tool_call(call, where: str) -> dict:
    if not isinstance(call, dict) or call.get("type", "function") != "function" \
            or not isinstance(call.get("function"), dict):
        raise ValueError(f"{where} must be an object with type \"function\" and a function object")
    function = call["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object encoded as a string")
    rendered = {"type": "function", "function": {"name": function["name"], "arguments": parsed}}
    if call.get("id") is not None:
        rendered["id"] = str(call["id"])
    return rendered
