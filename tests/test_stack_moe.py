"""A mixture-of-experts model through the whole stack (OpenAI SDK → adapter → Triton → engine): the tiny random
Mixtral's routing comes back in `sglext.routed_experts`, equal to transformers' router choices."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer, MixtralForCausalLM

from stack_helpers import EXACT_OPTIONS, running_stack
from tiny_models import TOP_K, tiny_config, write_tiny_model

PROMPT = "The capital of France is"
MAX_TOKENS = 5
LAYERS = tiny_config("mixtral").num_hidden_layers


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, default_model_dir):
    return write_tiny_model(tmp_path_factory.mktemp("mixtral") / "tiny-mixtral", default_model_dir, "mixtral")


@pytest.fixture(scope="module")
def moe_stack(mixtral_dir, tmp_path_factory):
    with running_stack(mixtral_dir, tmp_path_factory.mktemp("moe-stack"), *EXACT_OPTIONS,
                       "--kv-cache-memory", "4MiB") as process:
        yield process.stack


@pytest.fixture(scope="module")
def client(moe_stack) -> OpenAI:
    return OpenAI(base_url=moe_stack.base_url, api_key="unused", max_retries=0)


def test_routed_experts_match_transformers_router(client, moe_stack, mixtral_dir):
    completion = client.completions.create(model=moe_stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, n=2, extra_body={"return_routed_experts": True,
                                                                           "ignore_eos": True})
    routed = completion.model_extra["sglext"]["routed_experts"]
    assert len(routed) == 2 and routed[0] == routed[1]  # greedy: both choices take the same path
    assert torch.tensor(routed[0]).shape == (MAX_TOKENS, LAYERS, TOP_K)
    assert "routed_experts" not in completion.choices[0].model_extra

    reference = MixtralForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # like ignore_eos
    tokenizer = AutoTokenizer.from_pretrained(mixtral_dir)
    prompt_ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        sequence = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        router_logits = reference(sequence, output_router_logits=True).router_logits
    assert completion.choices[0].text == tokenizer.decode(sequence[0, len(prompt_ids):])
    expected = torch.stack([logits.topk(TOP_K, dim=-1).indices for logits in router_logits], dim=1)
    # the generated token j came from the logits at position prompt_len - 1 + j
    assert routed[0] == expected[len(prompt_ids) - 1:-1].tolist()


def test_routed_experts_stream_with_their_tokens_in_chat(client, moe_stack):
    request = dict(model=moe_stack.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS,
                   temperature=0, logprobs=True, extra_body={"return_routed_experts": True, "ignore_eos": True})
    whole = client.chat.completions.create(**request)
    [expected] = whole.model_extra["sglext"]["routed_experts"]  # one row per token (checked against transformers above)
    assert torch.tensor(expected).shape == (MAX_TOKENS, LAYERS, TOP_K)
    chunks = [chunk for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices]
    streamed_tokens = 0
    for chunk in chunks:
        [rows] = chunk.model_extra["sglext"]["routed_experts"]
        tokens = len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        # each chunk carries the routing of exactly the tokens it carries, in order
        assert rows == expected[streamed_tokens:streamed_tokens + tokens]
        streamed_tokens += tokens
    assert streamed_tokens == MAX_TOKENS
    plain = client.completions.create(model=moe_stack.model_name, prompt=PROMPT, max_tokens=2)
    assert "sglext" not in plain.model_extra
