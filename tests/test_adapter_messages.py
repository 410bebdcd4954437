"""Anthropic's Messages API in the adapter, without Triton: a request becomes the chat's, a scripted chat answer
becomes Anthropic's message and event sequence, and errors have Anthropic's shape."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from stack_helpers import free_ports
from test_adapter_completions import ScriptedTriton

from tritonllm.adapter import AdapterSettings, create_app
from tritonllm.adapter.chat import ChatService
from tritonllm.adapter.completions import CompletionService, sampling_parameters
from tritonllm.adapter.errors import AdapterError
from tritonllm.adapter.messages import MessagesRequest, anthropic_message, message_events
from tritonllm.adapter.protocol import parse_request
from tritonllm.adapter.triton_client import ChoiceOutput, TritonChunk

MODEL = "m"
TOOLS = [{"name": "weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                 {"type": "text", "text": "And Rome?"}]},
]


def _parse(**fields) -> MessagesRequest:
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_request(json.dumps(body).encode(), MessagesRequest)


def test_a_message_request_becomes_the_chats():
    request = _parse(system=[{"type": "text", "text": "Be brief."}], messages=CONVERSATION, tools=TOOLS,
                     tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
                     stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=20,
                     thinking={"type": "disabled"}, metadata={"user_id": "u"})
    chat = request.chat_request()
    assert chat.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And Rome?"},
    ]
    assert chat.tool_inputs() == {"tools": json.dumps([{"type": "function", "function": {
        "name": "weather", "parameters": TOOLS[0]["input_schema"], "description": "The weather in a city"}}]),
        "parallel_tool_calls": False, "tool_choice": '{"type": "function", "function": {"name": "weather"}}'}
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert sampling_parameters(chat) == {"max_tokens": 20, "stop": ["\n\n"], "temperature": 0.5, "top_p": 0.9,
                                         "top_k": 20}
    assert _parse(tool_choice={"type": "any"}, tools=TOOLS).chat_request().tool_choice == "required"


@pytest.mark.parametrize("fields", [{"max_tokens": 0}, {"messages": []}, {"messages": [{"role": "system",
                                    "content": "x"}]}, {"unknown": 1}, {"temperature": -1},
                                    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}])
def test_bad_requests_are_400(fields):
    with pytest.raises(AdapterError) as caught:  # the shape here, the values by the engine's declarations
        sampling_parameters(_parse(**fields).chat_request())
    assert caught.value.status_code == 400


def _scripted(*outputs: ChoiceOutput) -> ChatService:
    request = _parse(tools=TOOLS, stop_sequences=["END"])
    key = str(request.chat_request().conversation())
    return ChatService(CompletionService(ScriptedTriton({key: [TritonChunk([output], 7, 2, None)
                                                               for output in outputs]}), MODEL))


CALL_DELTAS = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}},
               {"index": 0, "function": {"arguments": '{"city": '}}, {"index": 0, "function": {"arguments": '"Rome"}'}}]


async def test_a_tool_call_answer_is_a_tool_use_message_streamed_as_anthropic_events():
    request = _parse(tools=TOOLS, stop_sequences=["END"], stream=True)
    outputs = [ChoiceOutput("", None, [], 2, None, reasoning="Hmm.", num_reasoning_tokens=2),
               ChoiceOutput("Sure.", None, [], 1, None, reasoning="", num_reasoning_tokens=2),
               ChoiceOutput("", None, [], 2, None, tool_calls=CALL_DELTAS[:2], reasoning=""),
               ChoiceOutput("", "tool_calls", [], 1, None, tool_calls=CALL_DELTAS[2:], reasoning="")]
    chunks = _scripted(*outputs).stream(request.chat_request())
    first = await anext(chunks)
    events = [event async for event in message_events(first, chunks, request)]
    parsed = [(event.split("\n")[0], json.loads(event.split("\n")[1].removeprefix("data: "))) for event in events]
    assert all(name == f"event: {data['type']}" for name, data in parsed)
    types = [data["type"] for _, data in parsed]
    assert types == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    data = [data for _, data in parsed]
    assert data[0]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0, "cache_read_input_tokens": 2,
                                           "cache_creation_input_tokens": 0}
    assert [data[i]["content_block"]["type"] for i in (1, 4, 7)] == ["thinking", "text", "tool_use"]
    assert data[7]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {}}
    assert "".join(data[i]["delta"]["partial_json"] for i in (8, 9)) == '{"city": "Rome"}'
    assert [data[i]["index"] for i in range(1, 11)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert data[11] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                        "usage": {"output_tokens": 6}}

    whole = request.model_copy(update={"stream": False})
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    chat = await _scripted(ChoiceOutput("Sure.", "tool_calls", [], 6, None, tool_calls=[call], reasoning="Hmm.",
                                        num_reasoning_tokens=2)).complete(whole.chat_request())
    message = anthropic_message(chat, whole).model_dump()
    assert message["content"] == [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                  {"type": "text", "text": "Sure."},
                                  {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Rome"}}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    assert message["usage"]["output_tokens"] == 6 and message["id"].startswith("msg_")


@pytest.mark.parametrize("finish, matched, reason, sequence", [
    ("stop", "END", "stop_sequence", "END"), ("stop", 2, "end_turn", None), ("length", None, "max_tokens", None)])
async def test_stop_reasons(finish, matched, reason, sequence):
    request = _parse(tools=TOOLS, stop_sequences=["END"])
    chat = await _scripted(ChoiceOutput("Hi", finish, [], 1, matched)).complete(request.chat_request())
    message = anthropic_message(chat, request)
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)


@pytest.fixture(scope="module")
def down_client():
    """The app with Triton down: a request that passes validation is a 503."""
    settings = AdapterSettings(served_model_name=MODEL, triton_url=f"127.0.0.1:{free_ports(1)[0]}",
                               request_timeout_s=5, health_timeout_s=1.0)
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("path, body, status, error_type", [
    ("/v1/messages", b'{"model": ', 400, "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error"),  # no max_tokens
    ("/v1/messages", {"model": "other", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 503,
     "overloaded_error"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 503,
     "overloaded_error"),
    ("/v1/messages/count_tokens", {"model": MODEL}, 400, "invalid_request_error"),
])
def test_errors_have_anthropics_shape(down_client, path, body, status, error_type):
    response = down_client.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == error_type and error["error"]["message"]
    # the OpenAI routes keep OpenAI's
    assert set(down_client.post("/v1/chat/completions", json={"model": "other", "messages": []}).json()) == {"error"}
