"""Where clients written for a peer (OpenAI / vLLM / SGLang, Triton's vllm_backend) depend on its behaviour, the
whole stack behaves the same (issue 18): tried through `tritonllm serve` with the clients those peers' users run
(the openai SDK, plain HTTP and SSE, tritonclient.grpc)."""

from __future__ import annotations

import json
import uuid

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from stack_helpers import grpc_generate

PROMPT = "The capital of France is"
COUNTING = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8, 9, 10, ..."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _sse_chunks(stack, route: str, **body) -> list[dict]:
    """The JSON chunks of a streamed completion or chat completion, as they are on the wire."""
    with httpx.stream("POST", f"{stack.base_url}/{route}", json={"model": stack.model_name, **body},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _post(stack, route: str, **body) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/{route}", json={"model": stack.model_name, **body}, timeout=120)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# --- the Triton tensor interface as vllm_backend's clients read it (items 11-14) ------------------------------


def _strings(result, name: str) -> list[str] | None:
    array = result.as_numpy(name)
    return None if array is None else [item.decode() for item in array]


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_backend_client_reads_finish_reason_logprobs_and_token_counts(stack, stream):
    params = {"max_tokens": 8, "temperature": "0", "logprobs": 2, "ignore_eos": True}
    responses, error = grpc_generate(stack, PROMPT, params, stream, return_logprobs=True,
                                     return_cumulative_logprob=True)
    assert error is None and len(responses) == (8 if stream else 1)
    for i, result in enumerate(responses):
        # "None" (Python's str(None)) until the choice ends, as vllm_backend sends it
        [finish_reason] = _strings(result, "finish_reason")
        assert finish_reason == ("length" if i == len(responses) - 1 else "None")
        # each response counts its own tokens, one logprobs entry per token
        [logprobs] = [json.loads(entries) for entries in _strings(result, "logprobs")]
        [num_output_tokens] = result.as_numpy("num_output_tokens").tolist()
        assert len(logprobs) == num_output_tokens == (1 if stream else 8)
        greedy_text = ""
        for entry in logprobs:  # {token id: {logprob, rank, decoded_token}}: the token and its top 2
            assert 1 <= len(entry) <= 3 and all(token_id.isdigit() for token_id in entry)
            assert all(set(value) == {"logprob", "rank", "decoded_token"} for value in entry.values())
            [top] = [value for value in entry.values() if value["rank"] == 1]
            greedy_text += top["decoded_token"]
        [text] = _strings(result, "text_output")
        assert (PROMPT + greedy_text if not stream else greedy_text) == text
    # without logprobs in the sampling parameters: null, not an empty list
    [final], error = grpc_generate(stack, PROMPT, {"max_tokens": 2}, False, return_logprobs=True)
    assert error is None and _strings(final, "logprobs") == ["null"]


def test_vllm_backend_refuses_streaming_the_prompt(stack):
    responses, error = grpc_generate(stack, PROMPT, {"max_tokens": 2}, True, exclude_input_in_output=False)
    assert responses == [] and "[invalid_request] exclude_input_in_output false cannot be streamed" in str(error)
    streamed, error = grpc_generate(stack, PROMPT, {"max_tokens": 2}, True, exclude_input_in_output=True)
    assert error is None and streamed


# --- logprobs as OpenAI gives them (item 2) -------------------------------------------------------------------


def test_top_logprobs_always_hold_the_sampled_token(complete):
    greedy = complete(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0).choices[0].logprobs
    assert greedy.top_logprobs == [{token: logprob} for token, logprob in zip(greedy.tokens, greedy.token_logprobs)]
    # sampled far from the top: the sampled token comes on top of the `logprobs` most likely ones
    sampled = complete(prompt=PROMPT, max_tokens=24, temperature=2.0, seed=3, logprobs=1).choices[0].logprobs
    outside = 0
    for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs):
        assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2
        outside += len(top) == 2
    assert outside > 0


def test_chat_top_logprobs_are_exactly_the_most_likely(client, stack):
    for top_logprobs in (0, 2):
        chat = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=12,
                                              temperature=2.0, seed=3, logprobs=True, top_logprobs=top_logprobs)
        assert all(len(entry.top_logprobs) == top_logprobs for entry in chat.choices[0].logprobs.content)


# --- streamed choices, one per chunk (item 1), and hidden states in SGLang's stream shape (item 9) ------------


@pytest.mark.parametrize("route, body", [
    ("completions", {"prompt": [PROMPT, COUNTING], "n": 2}),
    ("chat/completions", {"messages": MESSAGES, "n": 3}),
])
def test_streamed_chunks_carry_one_choice_each(stack, route, body):
    body = {**body, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    whole = _post(stack, route, **body).json()["choices"]
    chunks = _sse_chunks(stack, route, stream=True, **body)
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)  # clients read choices[0]
    texts = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (
            choice["text"] if route == "completions" else choice["delta"]["content"])
    assert texts == {choice["index"]: choice.get("text", choice.get("message", {}).get("content")) for choice in whole}


def test_streamed_hidden_states_follow_each_choice_text_in_a_chunk_of_their_own(stack):
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_hidden_states": True}
    whole = _post(stack, "completions", **body).json()["choices"]
    *chunks, usage = _sse_chunks(stack, "completions", stream=True, stream_options={"include_usage": True}, **body)
    text_chunks, trailing = chunks[:-2], chunks[-2:]
    assert all("hidden_states" not in chunk["choices"][0] for chunk in text_chunks)
    assert sorted(chunk["choices"][0]["index"] for chunk in trailing) == [0, 1]
    for chunk in trailing:
        [choice] = chunk["choices"]
        assert (choice["text"], choice["finish_reason"]) == ("", None)
        np.testing.assert_allclose(choice["hidden_states"], whole[choice["index"]]["hidden_states"], atol=1e-4)
        assert len(choice["hidden_states"]) == 3 and len(choice["hidden_states"][0]) == 576
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6

    *chat_chunks, last = _sse_chunks(stack, "chat/completions", messages=MESSAGES, max_tokens=3, stream=True,
                                     return_hidden_states=True)
    assert all("hidden_states" not in chunk["choices"][0] and "hidden_states" not in chunk["choices"][0]["delta"]
               for chunk in chat_chunks)
    [choice] = last["choices"]
    assert "hidden_states" not in choice and choice["finish_reason"] is None  # SGLang: in the delta
    assert len(choice["delta"]["hidden_states"]) == 3


# --- null inside stream_options (item 5); parameters accepted but ignored are refused (item 6) ----------------


def test_null_inside_stream_options_means_the_default(stack):
    chunks = _sse_chunks(stack, "completions", prompt=PROMPT, max_tokens=3, stream=True,
                         stream_options={"include_usage": None, "continuous_usage_stats": None})
    assert chunks and all("usage" not in chunk for chunk in chunks)  # the defaults: no usage chunk
    with_usage = _sse_chunks(stack, "chat/completions", messages=MESSAGES, max_tokens=3, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": None})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("route, field, value", [
    ("completions", "structured_outputs", {"regex": "[0-9]+"}),
    ("completions", "guided_whitespace_pattern", " "),
    ("chat/completions", "chat_template", "{{ messages[0].content }}"),
    ("chat/completions", "functions", [{"name": "f", "parameters": {}}]),
])
def test_unsupported_non_neutral_parameters_are_400_not_ignored(stack, route, field, value):
    prompt = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    error = _error(_post(stack, route, max_tokens=1, **prompt, **{field: value}))
    assert error["param"] == field and "not supported" in error["message"]


# --- chat content as a list of parts (item 3) -----------------------------------------------------------------


def test_chat_content_parts_are_concatenated_text(stack, client):
    as_string = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=8,
                                               temperature=0)
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}]
    as_parts = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": parts}],
                                              max_tokens=8, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    error = _error(_post(stack, "chat/completions", messages=[{"role": "user", "content": [parts[0], image]}]))
    assert error["param"] == "messages" and "'image_url' are not supported" in error["message"]


# --- GET /v1/models/{model}, and max_model_len in the entries (item 4) ----------------------------------------


def test_models_are_retrieved_one_by_one_with_max_model_len(stack, client):
    listed = httpx.get(f"{stack.base_url}/models", timeout=30).json()["data"]
    assert {card["id"] for card in listed} >= {stack.model_name, f"{stack.model_name}:alpha"}
    for card in listed:
        assert httpx.get(f"{stack.base_url}/models/{card['id']}", timeout=30).json() == card
        assert card["max_model_len"] == listed[0]["max_model_len"]
    model = client.models.retrieve(stack.model_name)
    assert (model.id, model.object, model.owned_by) == (stack.model_name, "model", "tritonllm")
    # max_model_len is the engine's own limit: one token more than it holds is refused
    max_model_len = listed[0]["max_model_len"]
    prompt_tokens = _post(stack, "completions", prompt=PROMPT, max_tokens=1).json()["usage"]["prompt_tokens"]
    error = _error(_post(stack, "completions", prompt=PROMPT, max_tokens=max_model_len - prompt_tokens + 1))
    assert f"context length of {max_model_len} tokens" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    error = _error(httpx.get(f"{stack.base_url}/models/{stack.model_name}:no-such-adapter", timeout=30), 404)
    assert error["code"] == "model_not_found"


# --- cache_salt separates the prefix cache (item 8) -----------------------------------------------------------


def test_cache_salt_separates_cached_prefixes(stack):
    prompt = f"Request {uuid.uuid4().hex}: " + "a long shared system prompt, " * 8  # several KV blocks, unseen

    def cached(**fields) -> int:
        usage = _post(stack, "completions", prompt=prompt, max_tokens=1, **fields).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") >= 32  # the same salt shares the prefix
    assert cached(cache_salt="tenant-b") == 0  # another salt does not
    assert cached() == 0  # nor does no salt
    assert cached() >= 32
    assert cached(cache_salt="tenant-b") >= 32


# --- vLLM's prompt_logprobs -----------------------------------------------------------------------------------


def test_prompt_logprobs_as_vllm_gives_them(stack):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2}
    plain = _post(stack, "completions", **body).json()
    assert all("prompt_logprobs" in choice and choice["prompt_logprobs"] is None for choice in plain["choices"])
    scored = _post(stack, "completions", prompt_logprobs=2, **body).json()
    # echo with logprobs 2 scores the same prompt tokens, OpenAI's way
    echoed = _post(stack, "completions", echo=True, logprobs=2, **{**body, "n": 1}).json()["choices"][0]["logprobs"]
    prompt_tokens = scored["usage"]["prompt_tokens"]
    for choice in scored["choices"]:
        prompt_logprobs = choice["prompt_logprobs"]
        assert len(prompt_logprobs) == prompt_tokens and prompt_logprobs[0] is None  # nothing predicts the first
        assert choice["logprobs"] is None and choice["text"] == plain["choices"][0]["text"]
        for position, entry in enumerate(prompt_logprobs[1:], start=1):
            assert 1 <= len(entry) <= 3 and all(set(value) == {"logprob", "rank", "decoded_token"}
                                                for value in entry.values())
            token = next(iter(entry.values()))  # the prompt token itself first
            assert token["decoded_token"] == echoed["tokens"][position]
            assert token["logprob"] == pytest.approx(echoed["token_logprobs"][position], abs=1e-5)
            assert sorted(value["rank"] for value in entry.values())[:2] == [1, 2]
    error = _error(_post(stack, "completions", prompt_logprobs=1, stream=True, **body))
    assert error["param"] == "prompt_logprobs"
    error = _error(_post(stack, "completions", prompt_logprobs=21, **body))
    assert error["param"] == "prompt_logprobs" and "[0, 20]" in error["message"]


# --- vLLM's allowed_token_ids ---------------------------------------------------------------------------------


def test_allowed_token_ids_are_the_only_tokens_generated(stack, default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    allowed = [tokenizer.convert_tokens_to_ids(token) for token in ("7", ",", "Ġ8")]
    texts = {tokenizer.decode([token_id]) for token_id in allowed}
    body = {"prompt": COUNTING, "max_tokens": 12, "logprobs": 0, "allowed_token_ids": allowed}
    for sampling in ({"temperature": 0}, {"temperature": 1.5, "seed": 5, "n": 2}):
        for choice in _post(stack, "completions", **body, **sampling).json()["choices"]:
            assert set(choice["logprobs"]["tokens"]) <= texts and len(choice["logprobs"]["tokens"]) == 12
    free = _post(stack, "completions", prompt=COUNTING, max_tokens=12, temperature=0).json()["choices"][0]["text"]
    assert free.startswith(" 5, 6")  # (so the allowed tokens did change the output)
    error = _error(_post(stack, "completions", prompt=COUNTING, allowed_token_ids=[10**6]))
    assert error["param"] == "allowed_token_ids" and "outside the vocabulary" in error["message"]


# --- SGLang's structural_tag response format (item 10) --------------------------------------------------------

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "unit": {"enum": ["C", "F"]}},
                  "required": ["city", "unit"], "additionalProperties": False}  # unlike the prompt's examples
STRUCTURAL_TAG = {"type": "structural_tag", "triggers": ["<function="],
                  "structures": [{"begin": "<function=get_weather>", "schema": WEATHER_SCHEMA, "end": "</function>"}]}
TOOL_PROMPT = ('Calls of the weather tool, one per line:\n<function=get_weather>{"city": "Paris"}</function>\n'
               '<function=get_weather>{"city": "Rome"}</function>\n')


def test_structural_tag_constrains_what_follows_each_trigger(stack):
    body = {"prompt": TOOL_PROMPT, "max_tokens": 40, "temperature": 0, "stop": ["\n\n"]}
    text = _post(stack, "completions", response_format=STRUCTURAL_TAG, **body).json()["choices"][0]["text"]
    calls = text.split("<function=")[1:]
    assert calls, text  # the examples make the model call the tool
    free = _post(stack, "completions", **body).json()["choices"][0]["text"]
    assert '"unit"' not in free  # (so the schema, not the examples, gave the unit)
    for call in calls[:-1] if not text.rstrip().endswith("</function>") else calls:  # (max_tokens may cut the last)
        arguments = call.removeprefix("get_weather>").split("</function>")[0]
        assert call.startswith("get_weather>") and set(json.loads(arguments)) == {"city", "unit"}, text
    for bad, message in [
        ({**STRUCTURAL_TAG, "triggers": ["<tool>"]}, "starts with none of the triggers"),
        ({"type": "structural_tag", "format": {"type": "const_string", "value": 1}}, "format.value must be a string"),
        ({"type": "structural_tag", "triggers": ["<"]}, "needs structures and triggers"),
    ]:
        error = _error(_post(stack, "completions", response_format=bad, **body))
        assert error["param"] == "response_format" and message in error["message"]
