"""The APIs agents and reasoning models are called through, end to end: `tritonllm serve` with a tiny random Qwen3
whose chat template thinks (tests/tiny_models.py), and the official SDKs: openai's chat completions with the
reasoning apart from the answer; anthropic's Messages API (thinking, text and tool_use blocks, streamed or not);
openai's Responses API (reasoning, message and function_call items, streamed or not)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from stack_helpers import EXACT_OPTIONS, running_stack
from tiny_models import write_thinking_model

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinking_stack(default_model_dir, tmp_path_factory):
    model_dir = write_thinking_model(tmp_path_factory.mktemp("thinking") / "tiny-qwen3-thinking", default_model_dir)
    with running_stack(model_dir, tmp_path_factory.mktemp("thinking-stack"), *EXACT_OPTIONS,
                       "--kv-cache-memory", "16MiB") as process:
        yield process.stack


@pytest.fixture(scope="module")
def openai_client(thinking_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinking_stack.base_url, api_key="unused", max_retries=0, timeout=120)


def test_chat_reasoning_is_apart_from_the_answer_streamed_or_not(thinking_stack, openai_client):
    kwargs = dict(model=thinking_stack.model_name, messages=MESSAGES, max_tokens=10, temperature=0)
    whole = openai_client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    # the random model never writes </think>: everything is reasoning, counted as such
    assert message.model_extra["reasoning_content"] and message.content == ""
    assert whole.usage.completion_tokens == 10 and whole.usage.completion_tokens_details.reasoning_tokens == 10
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True,
                                                        stream_options={"include_usage": True}))
    streamed = "".join(chunk.choices[0].delta.model_extra.get("reasoning_content") or ""
                       for chunk in chunks if chunk.choices)
    assert streamed == message.model_extra["reasoning_content"]
    assert all(not chunk.choices[0].delta.content for chunk in chunks if chunk.choices)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 10


def test_separate_reasoning_false_keeps_the_reasoning_in_the_content(thinking_stack, openai_client):
    kwargs = dict(model=thinking_stack.model_name, messages=MESSAGES, max_tokens=10, temperature=0)
    separate = openai_client.chat.completions.create(**kwargs).choices[0].message
    raw = openai_client.chat.completions.create(**kwargs, extra_body={"separate_reasoning": False}).choices[0].message
    assert raw.content == separate.model_extra["reasoning_content"] and separate.content == ""
    assert "reasoning_content" not in (raw.model_extra or {})


def test_enable_thinking_false_answers_without_reasoning(thinking_stack, openai_client):
    whole = openai_client.chat.completions.create(model=thinking_stack.model_name, messages=MESSAGES, max_tokens=6,
                                                  temperature=0, extra_body={
                                                      "chat_template_kwargs": {"enable_thinking": False}})
    message = whole.choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
    assert whole.usage.completion_tokens_details is None


# --- Anthropic's Messages API through the anthropic SDK ---------------------------------------------------------

TOOLS = [{"name": "weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}]
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def anthropic_client(thinking_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=thinking_stack.base_url.removesuffix("/v1"), api_key="unused",
                               max_retries=0, timeout=120)


def test_messages_answer_with_thinking_then_text_streamed_or_not(thinking_stack, anthropic_client, openai_client):
    # (the SDK types no sampling parameters since 2.x: they go as extra fields, as the API still takes them)
    kwargs = dict(model=thinking_stack.model_name, max_tokens=10, extra_body={"temperature": 0},
                  system="Be brief.", messages=MESSAGES)
    message = anthropic_client.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["thinking"]  # (the random model never ends it)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 10)
    chat = openai_client.chat.completions.create(model=thinking_stack.model_name, max_tokens=10, temperature=0,
                                                 messages=[{"role": "system", "content": "Be brief."}, *MESSAGES])
    assert message.content[0].thinking == chat.choices[0].message.model_extra["reasoning_content"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = anthropic_client.messages.count_tokens(model=thinking_stack.model_name, system="Be brief.",
                                                     messages=MESSAGES)
    assert counted.input_tokens == chat.usage.prompt_tokens

    with anthropic_client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert streamed.content == message.content and streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == 10

    text = anthropic_client.messages.create(**kwargs | {"max_tokens": 6}, thinking=NO_THINKING)
    assert [block.type for block in text.content] == ["text"] and text.content[0].text


def test_messages_tool_use_streamed_or_not_and_a_tool_result_turn(thinking_stack, anthropic_client):
    kwargs = dict(model=thinking_stack.model_name, max_tokens=40, extra_body={"temperature": 0}, messages=MESSAGES,
                  tools=TOOLS, tool_choice={"type": "any"}, thinking=NO_THINKING)
    message = anthropic_client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "weather" and call.input["city"] in ("Paris", "Rome")
    with anthropic_client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]

    answer = anthropic_client.messages.create(
        model=thinking_stack.model_name, max_tokens=5, extra_body={"temperature": 0}, thinking=NO_THINKING,
        tools=TOOLS, stop_sequences=["\n"], messages=[*MESSAGES, {"role": "assistant", "content": message.content},
                                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                                        "content": "sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "stop_sequence")


def test_messages_errors_have_anthropics_shape(thinking_stack, anthropic_client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic_client.messages.create(model="claude-nothing", max_tokens=5, messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(model=thinking_stack.model_name, max_tokens=5, messages=MESSAGES,
                                         extra_body={"top_p": 0.0})
    assert caught.value.body["type"] == "error" and "top_p" in caught.value.body["error"]["message"]


# --- OpenAI's Responses API through the openai SDK -------------------------------------------------------------

FUNCTION = {"type": "function", "name": "weather", "description": "The weather in a city",
            "parameters": TOOLS[0]["input_schema"]}


def test_responses_reasoning_and_text_streamed_or_not(thinking_stack, openai_client):
    kwargs = dict(model=thinking_stack.model_name, input="What is the capital of France?", instructions="Be brief.",
                  max_output_tokens=10, temperature=0)
    response = openai_client.responses.create(**kwargs)
    assert response.object == "response" and response.status == "incomplete"  # max_output_tokens ran out
    assert response.incomplete_details.reason == "max_output_tokens"
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert response.usage.output_tokens == 10 and response.usage.output_tokens_details.reasoning_tokens == 10
    events = list(openai_client.responses.create(**kwargs, stream=True))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    streamed = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text
    assert events[-1].response.output[0].content[0].text == streamed
    assert [event.sequence_number for event in events] == list(range(len(events)))

    answer = openai_client.responses.create(**kwargs, reasoning={"effort": "none"})
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        openai_client.responses.create(**kwargs, previous_response_id="resp_123")


def test_responses_function_call_streamed_or_not_and_its_output_turn(thinking_stack, openai_client):
    kwargs = dict(model=thinking_stack.model_name, input="Weather in Paris?", tools=[FUNCTION],
                  tool_choice="required", max_output_tokens=40, temperature=0, reasoning={"effort": "none"})
    response = openai_client.responses.create(**kwargs)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and call.name == "weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    events = list(openai_client.responses.create(**kwargs, stream=True))
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments and events[-1].type == "response.completed"
    with openai_client.responses.stream(**kwargs) as stream:  # the SDK's accumulating helper
        final = stream.get_final_response()
    assert [(item.name, item.arguments) for item in final.output if item.type == "function_call"] == \
        [(call.name, call.arguments)]

    follow_up = openai_client.responses.create(
        model=thinking_stack.model_name, max_output_tokens=5, temperature=0, reasoning={"effort": "none"},
        tools=[FUNCTION], input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
                                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow_up.status in ("completed", "incomplete")
