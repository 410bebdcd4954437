"""Tool calling through the whole stack with the official openai SDK: tool_choice required / named / auto / none,
streamed calls (id and name first, then argument fragments), a conversation with a call and its result, the
errors, the same over tritonclient, and the constraint's promise: every call that comes out, sampled at
temperature 1 from a 135M model beside other requests, parses and validates against its function's schema."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from stack_helpers import grpc_stream
from transformers import AutoTokenizer


def closed(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


def function(name: str, parameters: dict | None, description: str = "") -> dict:
    spec = {"name": name, "description": description}
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


WEATHER = function("get_weather", closed({"city": {"type": "string", "maxLength": 20},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"]),
                   "The current weather in a city")
BOOKING = function("book_flight", closed({
    "passenger": closed({"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120}}),
    "seats": {"type": "array", "items": {"enum": ["aisle", "window", "middle"]}, "minItems": 1, "maxItems": 3},
    "return_trip": {"type": "boolean"}}), "Book a flight for a passenger")
SEARCH = function("search", closed({"query": {"type": "string", "maxLength": 25},
                                    "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, required=["query"]),
                  "Search the web")
CLOCK = function("current_time", None, "The current time (no parameters)")
TOOLS = [WEATHER, BOOKING, SEARCH, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters",
                                                           {"type": "object", "additionalProperties": False})
           for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


def check_call(call) -> dict:
    """A returned call parses and validates against its function's schema; its arguments as an object."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture
def chat(stack):
    """client.chat.completions.create with the served model filled in (a patient client: the concurrent test's
    requests share a CPU)."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=600)
    return lambda **kwargs: client.chat.completions.create(model=stack.model_name, **kwargs)


def streamed(chat, **kwargs) -> tuple[str, dict[int, dict], list, str]:
    """(content, calls by index as {id, name, arguments}, the tool-call deltas in order, finish reason)."""
    content, calls, deltas, finish = "", {}, [], None
    for chunk in chat(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                if delta.id is not None:
                    assert delta.index not in calls and delta.function.name and delta.type == "function"
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, deltas, finish


def test_required_returns_a_valid_call(chat):
    response = chat(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                    temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_function_is_the_call(chat):
    response = chat(messages=ASK, tools=TOOLS, tool_choice=named("book_flight"), max_tokens=150, temperature=0)
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "book_flight" and response.choices[0].finish_reason == "tool_calls"
    check_call(call)


def test_streamed_call_is_id_and_name_then_argument_fragments(chat):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=named("get_weather"), max_tokens=100, temperature=0)
    content, calls, deltas, finish = streamed(chat, **kwargs)
    whole = chat(**kwargs).choices[0].message.tool_calls[0]
    assert finish == "tool_calls" and content == ""
    assert deltas[0].id is not None and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2 and all(delta.id is None and delta.function.name is None for delta in deltas[1:])
    (call,) = calls.values()
    assert call["name"] == whole.function.name and call["arguments"] == whole.function.arguments
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])


def test_auto_may_answer_in_text_or_call(chat):
    """auto: free text until the model opens a call (the tiny model's greedy choice either way); no markup leaks."""
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        response = chat(messages=messages, tools=TOOLS, max_tokens=80, temperature=0)
        choice = response.choices[0]
        assert "<tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_call(call)
        content, calls, _, finish = streamed(chat, messages=messages, tools=TOOLS, max_tokens=80, temperature=0)
        assert content == (choice.message.content or "") and finish == choice.finish_reason
        assert [c["arguments"] for c in calls.values()] == \
            [c.function.arguments for c in choice.message.tool_calls or []]


def test_none_renders_tools_but_parses_nothing(chat):
    response = chat(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    plain = chat(messages=ASK, max_tokens=30, temperature=0).choices[0].message.content
    assert choice.message.content != plain  # the tools were in the prompt


def test_conversation_with_a_call_and_its_result(chat, stack, default_model_dir):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    response = chat(messages=messages, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0)
    assert response.choices[0].message.content and response.usage.prompt_tokens > 100
    tokenized = httpx.post(stack.base_url.removesuffix("/v1") + "/tokenize",
                           json={"model": stack.model_name, "messages": messages, "tools": TOOLS}).json()
    text = AutoTokenizer.from_pretrained(default_model_dir).decode(tokenized["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "not unique"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tools": TOOLS, "tool_choice": named("nowhere")}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "one of"),
    ({"tools": [function("f", {"type": "object", "properties": {"a": {"type": "no-such-type"}}})]},
     "tools", "tools[0].function.parameters"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "18"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages", "arguments"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_input_is_400_naming_the_field(chat, fields, param, message, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        response = chat(**{"messages": ASK, "max_tokens": 5, **fields}, stream=stream)
        for _ in response:
            pass
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and message in error["message"], error


def _sampled_call(chat, index: int):
    tool = TOOLS[index % len(TOOLS)]
    kwargs = dict(messages=[{"role": "user", "content": f"Request {index}: do something useful."}], tools=TOOLS,
                  tool_choice=["required", named(tool["function"]["name"])][index % 2],
                  parallel_tool_calls=index % 3 == 0, temperature=1.0, seed=index, max_tokens=120)
    if index % 4 == 1:
        _, calls, _, finish = streamed(chat, **kwargs)
        return finish, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    choice = chat(**kwargs).choices[0]
    return choice.finish_reason, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_every_sampled_call_parses_and_validates_under_concurrency(chat):
    """24 tool-calling requests at temperature 1 (streamed and not, 4 schemas: nested objects, enums, arrays,
    required and optional fields, no parameters) run beside 6 plain chats; every call validates. (8 at a time: the
    stack's KV cache runs about 4 of these prompts at once, and its queue holds 8.)"""
    with ThreadPoolExecutor(8) as pool:
        plain = [pool.submit(chat, messages=[{"role": "user", "content": f"Tell me about {i}."}], max_tokens=40,
                             temperature=1.0, seed=i) for i in range(6)]
        sampled = [pool.submit(_sampled_call, chat, index) for index in range(24)]
        results = [future.result() for future in sampled]
        assert all(future.result().choices[0].message.content is not None for future in plain)
    finished = [calls for finish, calls in results if finish == "tool_calls"]
    assert len(finished) >= 20, results  # (a call may run out of max_tokens: then it ends with length)
    for calls in finished:
        assert calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _tool_inputs(messages, tools, tool_choice: str, stream: bool) -> list:
    def tensor(name, value, dtype):
        array = np.array([value.encode() if isinstance(value, str) else value],
                         dtype=np.object_ if isinstance(value, str) else None)
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t
    return [tensor("messages", json.dumps(messages), "BYTES"), tensor("tools", json.dumps(tools), "BYTES"),
            tensor("tool_choice", tool_choice, "BYTES"), tensor("stream", stream, "BOOL"),
            tensor("sampling_parameters", json.dumps({"max_tokens": 100, "temperature": 0}), "BYTES"),
            tensor("return_finish_reason", True, "BOOL")]




def test_tritonclient_tools_inputs_and_tool_calls_output(stack):
    choice = json.dumps(named("search"))
    (final,), error = grpc_stream(stack, _tool_inputs(ASK, TOOLS, choice, stream=False))
    assert error is None
    (call,) = json.loads(final.as_numpy("tool_calls")[0])
    assert call["function"]["name"] == "search" and final.as_numpy("finish_reason")[0] == b"tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["search"])
    assert final.as_numpy("text_output")[0] == b""
    responses, error = grpc_stream(stack, _tool_inputs(ASK, TOOLS, choice, stream=True))
    deltas = [delta for response in responses for delta in json.loads(response.as_numpy("tool_calls")[0])]
    assert error is None and deltas[0]["function"]["name"] == "search" and "id" in deltas[0]
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    _, error = grpc_stream(stack, _tool_inputs(ASK, TOOLS, json.dumps(named("nowhere")), stream=False))
    assert "[invalid_request:tool_choice]" in str(error)
