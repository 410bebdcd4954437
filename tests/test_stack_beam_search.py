"""Beam search through the whole stack with the openai SDK (vLLM's `use_beam_search` in `extra_body`): a beam
request runs in the engine's batch beside a streamed one, width 1 is greedy, chat too, and what it refuses is an
OpenAI-format 400 (streaming, as vLLM)."""

from __future__ import annotations

import threading
import time

import openai
import pytest

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
BEAMS = {"use_beam_search": True, "ignore_eos": True}


def test_a_beam_request_runs_beside_a_streamed_one(stack, client):
    stream = client.completions.create(model=stack.model_name, prompt="Write a long story about rivers.",
                                       max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunk_times = [time.monotonic()]
    next(iter(stream))  # decoding
    beams: dict = {}

    def beam_request():
        beams["response"] = client.completions.create(model=stack.model_name, prompt=PROMPT, n=3, max_tokens=6,
                                                      extra_body={**BEAMS, "best_of": 4, "length_penalty": 0.5})
        beams["done"] = time.monotonic()

    thread = threading.Thread(target=beam_request)
    thread.start()
    for _ in stream:
        chunk_times.append(time.monotonic())
    thread.join()
    response = beams["response"]
    # the beams finished while the streamed request was still decoding: it ran in the same batches, not after
    assert beams["done"] < chunk_times[-1] and sum(t > beams["done"] for t in chunk_times) >= 5
    texts = [choice.text for choice in response.choices]
    assert [choice.index for choice in response.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert all(choice.finish_reason == "length" for choice in response.choices)
    assert response.usage.completion_tokens == 18


def test_one_beam_is_greedy_and_chat_has_beams(stack, client):
    greedy = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    one_beam = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=8, extra_body=BEAMS)
    assert one_beam.choices[0].text == greedy.choices[0].text
    chat = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, n=2, max_tokens=6,
                                          extra_body=BEAMS)
    contents = [choice.message.content for choice in chat.choices]
    assert len(contents) == 2 and contents[0] != contents[1]


@pytest.mark.parametrize("route, extra, param", [
    ("completions", {"stream": True}, "use_beam_search"),
    ("chat", {"stream": True}, "use_beam_search"),
    ("completions", {"stop": ["."]}, "stop"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "use_beam_search"),
])
def test_what_beam_search_refuses_is_a_400(stack, client, route, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "completions":
            client.completions.create(model=stack.model_name, prompt=PROMPT, n=2, max_tokens=4,
                                      extra_body={**BEAMS, **extra})
        else:
            client.chat.completions.create(model=stack.model_name, messages=MESSAGES, n=2, max_tokens=4,
                                           extra_body={**BEAMS, **extra})
    assert refused.value.body["param"] == param
