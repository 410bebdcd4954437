"""OpenAI's Responses API in the adapter, without Triton: a request becomes the chat's, a scripted chat answer
becomes the response's output items and the stream's event sequence, and what is not kept is refused."""

from __future__ import annotations

import json

import pytest
from test_adapter_completions import ScriptedTriton

from tritonllm.adapter.chat import ChatService
from tritonllm.adapter.completions import CompletionService, sampling_parameters
from tritonllm.adapter.errors import AdapterError
from tritonllm.adapter.protocol import parse_request
from tritonllm.adapter.responses import ResponsesRequest, response_events, whole_response
from tritonllm.adapter.triton_client import ChoiceOutput, TritonChunk

MODEL = "m"
TOOL = {"type": "function", "name": "weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _parse(**fields) -> ResponsesRequest:
    return parse_request(json.dumps({"model": MODEL, "input": "Hi", **fields}).encode(), ResponsesRequest)


def test_a_responses_request_becomes_the_chats():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    request = _parse(input=items, instructions="You help.", tools=[TOOL], tool_choice={"type": "function",
                     "name": "weather"}, parallel_tool_calls=False, max_output_tokens=9, temperature=0.5,
                     store=False, reasoning={"effort": "low"}, metadata={"k": "v"})
    chat = request.chat_request()
    assert chat.conversation() == [
        {"role": "system", "content": "You help."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert json.loads(chat.tool_inputs()["tool_choice"]) == {"type": "function", "function": {"name": "weather"}}
    assert chat.tool_inputs()["parallel_tool_calls"] is False
    assert sampling_parameters(chat) == {"max_tokens": 9, "temperature": 0.5}
    structured = _parse(text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}})
    assert sampling_parameters(structured.chat_request())["json_schema"] == json.dumps(SCHEMA)
    assert _parse(reasoning={"effort": "none"}).chat_request().chat_template_kwargs == {"enable_thinking": False}
    assert chat.chat_template_kwargs is None


@pytest.mark.parametrize("fields, param", [({"store": True}, "store"), ({"previous_response_id": "resp_1"},
                                           "previous_response_id"), ({"input": [{"type": "web_search_call"}]},
                                           "input"), ({"tools": [{"type": "web_search"}]}, "tools"),
                                           ({"max_output_tokens": 0}, "max_output_tokens"),
                                           ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                                            "input")])
def test_what_is_not_kept_or_not_supported_is_400(fields, param):
    with pytest.raises(AdapterError) as caught:
        _parse(**fields).chat_request()
    assert (caught.value.status_code, caught.value.param) == (400, param)
    if param in ("store", "previous_response_id"):
        assert "stores no responses" in caught.value.message


CALL_DELTAS = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}},
               {"index": 0, "function": {"arguments": '{"city": "Rome"}'}}]


def _scripted(request: ResponsesRequest, *outputs: ChoiceOutput) -> ChatService:
    key = str(request.chat_request().conversation())
    return ChatService(CompletionService(ScriptedTriton({key: [TritonChunk([output], 7, 2, None)
                                                               for output in outputs]}), MODEL))


async def test_output_items_streamed_as_the_responses_events_and_whole():
    request = _parse(tools=[TOOL], stream=True)
    outputs = [ChoiceOutput("", None, [], 2, None, reasoning="Hmm.", num_reasoning_tokens=2),
               ChoiceOutput("Sure.", None, [], 1, None, reasoning="", num_reasoning_tokens=2),
               ChoiceOutput("", None, [], 2, None, tool_calls=CALL_DELTAS[:1], reasoning=""),
               ChoiceOutput("", "tool_calls", [], 1, None, tool_calls=CALL_DELTAS[1:], reasoning="")]
    chunks = _scripted(request, *outputs).stream(request.chat_request())
    events = [event async for event in response_events(await anext(chunks), chunks, request)]
    data = [json.loads(event.split("\n")[1].removeprefix("data: ")) for event in events]
    assert [event.split("\n")[0] for event in events] == [f"event: {item['type']}" for item in data]
    assert [item["sequence_number"] for item in data] == list(range(len(data)))
    assert [item["type"] for item in data] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = data[-1]["response"]
    assert final["id"] == data[0]["response"]["id"] and final["status"] == "completed"
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2] | {"id": None} == {"id": None, "type": "function_call", "call_id": "call_1",
                                                  "name": "weather", "arguments": '{"city": "Rome"}',
                                                  "status": "completed"}
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 6,
                              "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 13}

    whole = request.model_copy(update={"stream": False})
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    chat = await _scripted(whole, ChoiceOutput("Sure.", "tool_calls", [], 6, None, tool_calls=[call],
                                               reasoning="Hmm.", num_reasoning_tokens=2)).complete(whole.chat_request())
    response = whole_response(chat, whole).model_dump()
    strip = [{key: value for key, value in item.items() if key != "id"} for item in final["output"]]
    assert [{key: value for key, value in item.items() if key != "id"} for item in response["output"]] == strip
    assert response["usage"] == final["usage"]


async def test_max_output_tokens_makes_an_incomplete_response():
    request = _parse()
    chat = await _scripted(request, ChoiceOutput("Hel", "length", [], 3, None)).complete(request.chat_request())
    response = whole_response(chat, request)
    assert (response.status, response.incomplete_details) == ("incomplete", {"reason": "max_output_tokens"})
    assert response.output[0]["content"][0]["text"] == "Hel"
