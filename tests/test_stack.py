"""The whole stack for real: `tritonllm serve` (tritonserver + our decoupled model + the adapter), called with
the official openai SDK, plain HTTP, and tritonclient.grpc streaming."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import tritonclient.grpc as grpcclient
from transformers import AutoModelForCausalLM, AutoTokenizer

from stack_helpers import grpc_inputs, grpc_generate, grpc_stream, metric, wait_until_idle

PROMPT = "The capital of France is"
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_greedy(default_model_dir):
    """transformers' own greedy continuation of a prompt, as text."""
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)

    def run(prompt: str, max_tokens: int) -> str:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:]
        return tokenizer.decode(out, skip_special_tokens=True)

    return run


def test_greedy_text_matches_transformers(stack, client, hf_greedy):
    completion = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=32, temperature=0)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.model == stack.model_name
    [choice] = completion.choices
    assert choice.text == hf_greedy(PROMPT, 32)
    assert choice.text.startswith(" Paris")
    assert choice.finish_reason in ("stop", "length") and choice.index == 0
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_stream_matches_non_stream_and_reports_length(stack, client):
    kwargs = dict(model=stack.model_name, prompt="Once upon a time", max_tokens=20, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 3  # tokens arrive as they are generated
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason]
    assert reasons == ["length"] == [full.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert all(c.usage is None for c in text_chunks)


def test_async_concurrent_requests_each_match_alone(stack, client):
    prompts = ["Hello, my name is", "The best way to learn Python is", "1, 1, 2, 3, 5,", "Dear diary, today",
               "The recipe needs", "In 1969, astronauts"]
    alone = [client.completions.create(model=stack.model_name, prompt=p, max_tokens=16, temperature=0)
             .choices[0].text for p in prompts]

    async def together():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0) as aclient:
            async def one(prompt, stream):
                kwargs = dict(model=stack.model_name, prompt=prompt, max_tokens=16, temperature=0)
                if not stream:
                    return (await aclient.completions.create(**kwargs)).choices[0].text
                return "".join([c.choices[0].text async for c in await aclient.completions.create(**kwargs,
                                                                                                   stream=True)])
            return await asyncio.gather(*(one(p, i % 2 == 1) for i, p in enumerate(prompts)))

    assert asyncio.run(together()) == alone


def test_stop_sequences_through_the_adapter(stack, client):
    base = client.completions.create(model=stack.model_name, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = text[text.index("7"):text.index("7") + 4]  # spans several tokens, e.g. "7, 8"
    stopped = client.completions.create(model=stack.model_name, prompt="1, 2, 3, 4,", max_tokens=24,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=stack.model_name, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0, stop=[stop], stream=True))
    assert streamed == stopped.choices[0].text


def test_models_and_health(stack):
    models = httpx.get(f"{stack.base_url}/models").json()
    # the base model first, then the test stack's LoRA adapters (tests/test_stack_lora.py checks those)
    assert models["data"][0]["id"] == stack.model_name and models["object"] == "list"
    assert httpx.get(stack.base_url.removesuffix("/v1") + "/health").status_code == 200


@pytest.mark.parametrize("body, status, param", [
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ({"model": "{model}"}, 400, "prompt"),
    ({"model": "{model}", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "{model}", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "{model}", "prompt": 42}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(stack, body, status, param):
    body = {k: (v.format(model=stack.model_name) if isinstance(v, str) else v) for k, v in body.items()}
    response = httpx.post(f"{stack.base_url}/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_malformed_json_and_context_overflow(stack, client):
    response = httpx.post(f"{stack.base_url}/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=stack.model_name, prompt="hi", max_tokens=100000)


def test_tritonclient_streaming_and_non_streaming(stack, client):
    expected = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=12,
                                         temperature=0).choices[0].text
    # numbers as strings, as Triton clients often send them
    streamed, error = grpc_generate(stack, PROMPT, {"max_tokens": "12", "temperature": "0"}, stream=True)
    assert error is None and len(streamed) > 3
    assert "".join(r.as_numpy("text_output")[0].decode() for r in streamed) == expected
    assert streamed[-1].as_numpy("finish_reason")[0] == b"length"
    assert sum(r.as_numpy("num_output_tokens")[0] for r in streamed) == 12  # each response counts its own
    assert streamed[-1].as_numpy("num_input_tokens")[0] == 5
    [final], error = grpc_generate(stack, PROMPT, {"max_tokens": 12, "temperature": 0}, stream=False)
    assert error is None
    assert final.as_numpy("text_output")[0].decode() == PROMPT + expected  # prompt included unless excluded


@pytest.mark.parametrize("params, message", [
    ("{not json", "sampling_parameters is not valid JSON"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"max_tokens": 10**6}, "context length"),
])
def test_tritonclient_bad_parameters_fail_alone(stack, params, message):
    good_params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    [expected], error = grpc_generate(stack, PROMPT, good_params, stream=False)
    assert error is None
    with ThreadPoolExecutor(3) as pool:  # the bad request arrives while two good ones are generating
        goods = [pool.submit(grpc_generate, stack, PROMPT, good_params, stream=True) for _ in range(2)]
        time.sleep(0.3)
        bad = pool.submit(grpc_generate, stack, PROMPT, params, stream=True)
        responses, error = bad.result()
        assert responses == [] and message in str(error)
        assert not all(good.done() for good in goods), "the good requests ended before the bad one was sent"
        for good in goods:
            streamed, error = good.result()
            assert error is None
            assert PROMPT + "".join(r.as_numpy("text_output")[0].decode() for r in streamed) == \
                expected.as_numpy("text_output")[0].decode()


def test_client_disconnects_free_every_kv_block(stack):
    """Streams dropped mid-generation and non-streaming clients that time out are cancelled in the engine."""
    wait_until_idle(stack)
    generated_before = metric(stack, "tritonllm:generation_tokens_total")
    body = {"model": stack.model_name, "prompt": "Write a very long story about a dragon.", "max_tokens": 400,
            "temperature": 0.7, "ignore_eos": True}
    for _ in range(3):
        with httpx.stream("POST", f"{stack.base_url}/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines)
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{stack.base_url}/completions", json=body, timeout=1.5)
    wait_until_idle(stack)
    generated = metric(stack, "tritonllm:generation_tokens_total") - generated_before
    assert 0 < generated < 400, generated  # all five together made less than one of them asked for


def test_a_cancel_request_ends_the_request_it_names_and_its_stream_ends_by_itself(stack):
    """What the adapter does for a client that left (tritonllm/interface/tensors.py, CANCEL_INPUT): the request
    named ends at once with a cancelled error, its last response, so its gRPC stream ends without being cancelled;
    the cancel request answers whether it found it; nothing is left in the engine."""
    wait_until_idle(stack)
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    params = {"max_tokens": 400, "temperature": 0.7, "ignore_eos": True}
    try:
        client.async_stream_infer("llm", grpc_inputs(PROMPT, params, stream=True, flags={}),
                                  request_id="long-one", enable_empty_final_response=True)
        result, error = events.get(timeout=120)
        assert error is None and result.as_numpy("finish_reason")[0] == b"None"  # it runs

        def cancel(request_id: str) -> bool:
            cancel_input = grpcclient.InferInput("cancel_request_id", [1], "BYTES")
            cancel_input.set_data_from_numpy(np.array([request_id.encode()], dtype=np.object_))
            [answer], error = grpc_stream(stack, [cancel_input])
            assert error is None
            return bool(answer.as_numpy("cancelled")[0])

        assert cancel("long-one")
        tokens = 1
        while True:
            result, error = events.get(timeout=30)
            if error is not None:
                break
            assert not result.get_response().parameters["triton_final_response"].bool_param, "ended without error"
            tokens += 1
        assert "cancelled" in str(error) and tokens < 400
        assert not cancel("long-one") and not cancel("never-sent")
    finally:
        client.stop_stream()
        client.close()
    wait_until_idle(stack)  # the engine holds nothing: no request, no KV block


def test_engine_metrics_count_one_request_exactly(stack, client):
    counters = {"tritonllm:time_to_first_token_seconds_count": 1,  # one request of 5 tokens:
                "tritonllm:inter_token_latency_seconds_count": 4,  # 1 first token, 4 gaps, 5 tokens
                "tritonllm:generation_tokens_total": 5}
    wait_until_idle(stack)  # nothing of earlier tests still counting
    before = {name: metric(stack, name) for name in counters}
    while True:  # nor published late (the engine publishes every 0.5 s): the counters still for a second
        time.sleep(1.0)
        if (now := {name: metric(stack, name) for name in counters}) == before:
            break
        before = now
    client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=5, temperature=0, stream=False,
                              extra_body={"ignore_eos": True})

    def moved() -> dict:
        return {name: metric(stack, name) - before[name] for name in counters}

    deadline = time.monotonic() + 30  # observations are published by the engine's metrics poll
    while moved() != counters and time.monotonic() < deadline:
        time.sleep(0.2)
    assert moved() == counters
    assert metric(stack, "tritonllm:kv_cache_total_blocks") > 0


def test_triton_http_generate_endpoints(stack, client):
    """Triton's own generate extension and the examples/ scripts that use it and gRPC."""
    expected = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=8,
                                         temperature=0).choices[0].text
    body = {"text_input": PROMPT, "exclude_input_in_output": True, "return_finish_reason": True,
            "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})}
    whole = httpx.post(f"http://{stack.http_url}/v2/models/llm/generate", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.json()["text_output"] == expected and whole.json()["finish_reason"] == "length"
    events = []
    with httpx.stream("POST", f"http://{stack.http_url}/v2/models/llm/generate_stream",
                      json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) > 2 and "".join(e["text_output"] for e in events) == expected
    for script, url in (("examples/grpc_stream.py", stack.grpc_url), ("examples/http_generate.py",
                                                                       f"http://{stack.http_url}")):
        run = subprocess.run([sys.executable, script, "--url", url, "--max-tokens", "8", PROMPT],
                             capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith(expected)
