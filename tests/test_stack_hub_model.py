"""`tritonllm serve --model ORG/NAME` through the whole stack (OpenAI SDK → adapter → Triton → engine), offline
from a Hugging Face cache filled by hand with a tiny random llama: served under the id as given, with the
snapshot's weights (greedy text equal to transformers' on the same files)."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from hub_cache import add_model_dir_to_hub_cache
from stack_helpers import EXACT_OPTIONS, running_stack
from tiny_models import write_tiny_model

REPO_ID = "tritonllm-test/tiny-llama"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, default_model_dir):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama", default_model_dir, "llama")
    return add_model_dir_to_hub_cache(tmp_path_factory.mktemp("hf-cache"), REPO_ID, model_dir)


@pytest.fixture(scope="module")
def hub_stack(snapshot, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # the stack inherits them (StackProcess sets HF_HUB_OFFLINE=1)
        env.setenv("HF_HUB_CACHE", str(snapshot.parent.parent.parent))
        env.delenv("HF_HOME", raising=False)
        with running_stack(REPO_ID, tmp_path_factory.mktemp("hub-stack"), *EXACT_OPTIONS,
                           "--kv-cache-memory", "4MiB") as process:
            yield process.stack


def test_a_hub_id_is_served_under_its_id_from_its_snapshot(hub_stack, snapshot):
    client = OpenAI(base_url=hub_stack.base_url, api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == [REPO_ID]
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=REPO_ID, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.model == REPO_ID and chat.usage.completion_tokens == MAX_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    reference = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        sequence = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=None)
    expected = tokenizer.decode(sequence[0, len(prompt_ids):], skip_special_tokens=True)
    assert chat.choices[0].message.content == expected != ""
