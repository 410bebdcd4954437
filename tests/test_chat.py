"""Chat completions through the whole stack: the official openai SDK against `tritonllm serve`, the engine applying
the model's chat template."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_chat_matches_greedy_completion_of_the_rendered_template(stack, client, default_model_dir):
    rendered = AutoTokenizer.from_pretrained(default_model_dir).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)
    completion = client.completions.create(model=stack.model_name, prompt=rendered, max_tokens=24, temperature=0)
    chat = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=24, temperature=0)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.model == stack.model_name
    [choice] = chat.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == completion.choices[0].text and choice.message.content
    assert choice.finish_reason == completion.choices[0].finish_reason
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens
    assert chat.usage.completion_tokens == completion.usage.completion_tokens


def test_max_completion_tokens_wins_over_max_tokens(stack, client):
    chat = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=20,
                                          max_completion_tokens=3, temperature=0)
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def test_stream_chunks_have_chat_shape_and_match_non_stream(stack, client):
    kwargs = dict(model=stack.model_name, messages=MESSAGES, max_tokens=16, temperature=0, n=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *content_chunks, usage_chunk = chunks
    texts, finishes, roles = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for chunk in content_chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id
        assert chunk.id.startswith("chatcmpl-") and chunk.model == stack.model_name and chunk.usage is None
        for choice in chunk.choices:
            roles[choice.index].append(choice.delta.role)
            texts[choice.index] += choice.delta.content
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    for index in (0, 1):
        assert roles[index][0] == "assistant" and set(roles[index][1:]) <= {None}
        assert len(finishes[index]) == 1
        assert texts[index] == whole.choices[index].message.content
        assert finishes[index] == [whole.choices[index].finish_reason]
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == whole.usage.total_tokens


def test_stream_wire_format(stack):
    body = {"model": stack.model_name, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    first = httpx.Response(200, content=events[0].removeprefix("data: ")).json()
    assert set(first) == {"id", "object", "created", "model", "choices"}
    [choice] = first["choices"]
    assert set(choice) == {"index", "delta", "logprobs", "finish_reason", "matched_stop"}
    assert choice["delta"]["role"] == "assistant" and isinstance(choice["delta"]["content"], str)


def test_logprobs_in_chat_shape(stack, client):
    chat = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace")
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-4


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    [{"role": "wizard", "content": "hi"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
])
def test_bad_messages_are_400_naming_messages(stack, messages):
    response = httpx.post(f"{stack.base_url}/chat/completions", timeout=30,
                          json={"model": stack.model_name, "messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
