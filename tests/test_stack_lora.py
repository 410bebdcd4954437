"""LoRA adapters, hidden states and routed experts through the whole stack (OpenAI SDK → adapter → Triton)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from lora_helpers import merged_model, write_random_adapter

PROMPT = "The capital of France is"


def _text(client, model, **extra) -> str:
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body=extra or None)
    return completion.choices[0].text


def test_adapter_by_model_name_or_lora_path_differs_from_base(client, stack):
    base = _text(client, stack.model_name)
    alpha = _text(client, f"{stack.model_name}:alpha")
    assert alpha != base
    assert _text(client, stack.model_name, lora_path="alpha") == alpha
    # max_loras is 1: beta evicts alpha, and alpha loads again, with the same result
    assert _text(client, f"{stack.model_name}:beta") not in (alpha, base)
    assert _text(client, f"{stack.model_name}:alpha") == alpha
    chat = client.chat.completions.create(model=f"{stack.model_name}:alpha", max_completion_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == f"{stack.model_name}:alpha" and chat.choices[0].finish_reason


@pytest.mark.parametrize("fields, param", [({"model_suffix": ":nope"}, "model"), ({"lora_path": "nope"}, "lora_path"),
                                           ({"lora_path": "nope-\u00e9t\u00e9"}, "lora_path"),
                                           ({"lora_path": "nope\u0000"}, "lora_path")])
def test_unknown_adapter_is_404(client, stack, fields, param):
    model = stack.model_name + fields.pop("model_suffix", "")
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body=fields or None)
    error = raised.value.body
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", param, "invalid_request_error")
    assert "nope" in error["message"]


def test_adapter_path_outside_the_directory_is_400(client, stack):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=1,
                                  extra_body={"lora_path": str(stack.lora_dir.parent)})
    assert raised.value.body["param"] == "lora_path"
    assert "not inside the adapters directory" in raised.value.body["message"]


def test_models_lists_adapters_and_which_is_loaded(client, stack):
    _text(client, f"{stack.model_name}:beta")  # with one slot, beta is now the loaded adapter
    deadline = time.monotonic() + 10
    while True:  # the engine publishes its metrics every half second
        cards = {card.id: card.model_extra for card in client.models.list().data}
        if cards.get(f"{stack.model_name}:beta", {}).get("loaded") or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert list(cards) == [stack.model_name, f"{stack.model_name}:alpha", f"{stack.model_name}:beta"]
    max_model_len = cards[stack.model_name]["max_model_len"]
    assert cards[stack.model_name].pop("root") == stack.model_name  # SGLang's root: the served name
    roots = {name: Path(card.pop("root")).resolve()  # vLLM's: where it lives
             for name, card in cards.items() if name != stack.model_name}
    assert roots == {f"{stack.model_name}:alpha": (stack.lora_dir / "alpha").resolve(),
                     f"{stack.model_name}:beta": (stack.lora_dir / "beta").resolve()}
    assert cards[f"{stack.model_name}:beta"] == {"parent": stack.model_name, "loaded": True,
                                                "max_model_len": max_model_len}
    assert cards[f"{stack.model_name}:alpha"] == {"parent": stack.model_name, "loaded": False,
                                                 "max_model_len": max_model_len}
    assert cards[stack.model_name] == {"max_model_len": max_model_len}


def test_hidden_states_match_transformers_after_the_final_norm(client, stack, default_model_dir):
    completion = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                           echo=True, extra_body={"return_hidden_states": True, "ignore_eos": True})
    choice, usage = completion.choices[0], completion.usage
    rows = torch.tensor(choice.model_extra["hidden_states"])
    # one row per prompt token (echo), then one per generated token
    assert rows.shape == (usage.prompt_tokens + usage.completion_tokens, 576) == (usage.prompt_tokens + 4, 576)
    model = merged_model(default_model_dir, None)
    token_ids = AutoTokenizer.from_pretrained(default_model_dir).encode(PROMPT)
    with torch.no_grad():
        for _ in range(4):  # greedy, as the server ran
            token_ids.append(int(model(torch.tensor([token_ids])).logits[0, -1].argmax()))
        expected = model.model(torch.tensor([token_ids])).last_hidden_state[0]
    prompt_tokens = usage.prompt_tokens
    torch.testing.assert_close(rows[:prompt_tokens], expected[:prompt_tokens], atol=1e-3, rtol=1e-3)
    # a generated token's row is the one its logits came from: the position before it
    torch.testing.assert_close(rows[prompt_tokens:], expected[prompt_tokens - 1:-1], atol=1e-3, rtol=1e-3)


def test_hidden_states_in_chat_and_only_when_asked(client, stack):
    # (streamed: tests/test_stack_peer_parity.py)
    chat = client.chat.completions.create(model=stack.model_name, max_completion_tokens=3,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"return_hidden_states": True})
    assert len(chat.choices[0].model_extra["hidden_states"]) == chat.usage.completion_tokens
    plain = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=2)
    assert "hidden_states" not in plain.choices[0].model_extra


def test_hidden_states_beyond_the_server_bound_are_400(stack):
    response = httpx.post(f"{stack.base_url}/completions", timeout=30, json={
        "model": stack.model_name, "prompt": PROMPT, "max_tokens": 2100, "n": 2, "return_hidden_states": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "return_hidden_states" and "max_hidden_states_tokens" in error["message"]


def test_routed_experts_on_the_dense_model_is_400(stack):
    response = httpx.post(f"{stack.base_url}/completions", timeout=30, json={
        "model": stack.model_name, "prompt": PROMPT, "max_tokens": 1, "return_routed_experts": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "return_routed_experts" and "no experts" in error["message"]


def _lora_route(stack, route: str, **body) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/{route}_lora_adapter", json=body, timeout=60)


def test_runtime_adapter_load_serve_and_unload_while_in_use(client, stack):
    base, alpha = _text(client, stack.model_name), _text(client, f"{stack.model_name}:alpha")
    loaded = _lora_route(stack, "load", lora_name="sql-lora", lora_path="alpha")
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'sql-lora' added successfully."
    try:
        cards = {card.id: card for card in client.models.list().data}
        assert cards["sql-lora"].model_extra["parent"] == stack.model_name
        assert Path(cards["sql-lora"].model_extra["root"]).resolve() == (stack.lora_dir / "alpha").resolve()
        # vLLM's way (the name alone) and ours (<model>:<name>) both serve the adapter's weights
        assert _text(client, "sql-lora") == alpha != base
        assert _text(client, f"{stack.model_name}:sql-lora") == alpha
        assert _text(client, stack.model_name, lora_path="sql-lora") == alpha
        tokenized = httpx.post(f"{stack.base_url.removesuffix('/v1')}/tokenize", timeout=30,
                               json={"model": "sql-lora", "prompt": PROMPT})
        assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
        again = _lora_route(stack, "load", lora_name="sql-lora", lora_path="beta")
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        assert "has already been loaded" in again.json()["error"]["message"]

        stream = client.completions.create(model="sql-lora", prompt=PROMPT, max_tokens=64, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(stream)]
    finally:
        unloaded = _lora_route(stack, "unload", lora_name="sql-lora")
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'sql-lora' removed successfully."
    # at once: no longer listed, new requests refused, while the running one goes on with the adapter
    assert "sql-lora" not in {card.id for card in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as raised:
        _text(client, "sql-lora")
    assert raised.value.body["message"] == "The model 'sql-lora' does not exist."
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(chunk.choices[0].text for chunk in chunks)
    assert streamed.startswith(alpha)
    gone = _lora_route(stack, "unload", lora_name="sql-lora")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("body, status, param, words", [
    ({"lora_path": "alpha"}, 400, "lora_name", "Missing required parameter"),
    ({"lora_name": "x"}, 400, "lora_path", "Missing required parameter"),
    ({"lora_name": "", "lora_path": "alpha"}, 400, "lora_name", "at least 1 character"),
    ({"lora_name": "x", "lora_path": "alpha", "load_inplace": True}, 400, "load_inplace", "Unrecognized"),
    ({"lora_name": "x", "lora_path": 3}, 400, "lora_path", "valid string"),
    ({"lora_name": "alpha", "lora_path": "beta"}, 400, "lora_name", "has already been loaded"),  # a directory one
    ({"lora_name": "x", "lora_path": "nope"}, 404, "lora_path", "there is no LoRA adapter 'nope'"),
    ({"lora_name": "x", "lora_path": "../.."}, 400, "lora_path", "not inside the adapters directory"),
])
def test_runtime_adapter_bad_loads_name_the_field(client, stack, body, status, param, words):
    response = _lora_route(stack, "load", **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert "x" not in {card.id for card in client.models.list().data}


def test_runtime_adapter_the_engine_refuses_is_400(client, stack, default_model_dir):
    folder = stack.lora_dir / "too-wide"
    write_random_adapter(folder, default_model_dir, seed=9, rank=32)  # the stack's max_lora_rank is 16
    try:
        response = _lora_route(stack, "load", lora_name="wide", lora_path=str(folder))  # absolute, inside
    finally:
        shutil.rmtree(folder)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and "max_lora_rank=16" in error["message"]
    assert "wide" not in {card.id for card in client.models.list().data}
