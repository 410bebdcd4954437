"""The APIs agents and reasoning models are called through, end to end: `tritonllm serve` with a tiny random Qwen3
whose chat template thinks (tests/tiny_models.py), and the official SDKs: openai's chat completions with the
reasoning apart from the answer."""

from __future__ import annotations

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


def test_enable_thinking_false_answers_without_reasoning(thinking_stack, openai_client):
    whole = openai_client.chat.completions.create(model=thinking_stack.model_name, messages=MESSAGES, max_tokens=6,
                                                  temperature=0, extra_body={
                                                      "chat_template_kwargs": {"enable_thinking": False}})
    message = whole.choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
    assert whole.usage.completion_tokens_details is None
