"""bench/peers.py's long-prompt set-up: the prompts every server gets, and vLLM's dtype on this CPU."""

import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is scripts, not a package
import peers  # noqa: E402


def test_long_prompts_are_exact_ordinary_and_share_no_prefix(default_model_dir: Path):
    prompts = peers.long_prompts([16, 8000], default_model_dir)
    assert len(prompts.warm_up) == 16
    assert {length: [len(p) for p in of_length] for length, of_length in prompts.by_length.items()} == {
        16: [16] * peers.PROMPTS_PER_LENGTH, 8000: [8000] * peers.PROMPTS_PER_LENGTH}
    every = [prompts.warm_up, *(p for of_length in prompts.by_length.values() for p in of_length)]
    assert len({prompt[0] for prompt in every}) == len(every)  # no cached prefix on any server
    added = set(AutoTokenizer.from_pretrained(default_model_dir).added_tokens_decoder)
    assert added and not added & {token for prompt in every for token in prompt}
    assert peers.long_prompts([16, 8000], default_model_dir) == prompts  # the same on every server


@pytest.mark.parametrize("requested, bf16_hardware, isa, expected", [
    ("auto", True, "native", "bfloat16"),
    ("auto", False, "native", "float32"),
    ("auto", True, "avx2", "float32"),  # an AVX2-only box has no bf16 units
    ("float32", True, "native", "float32"),
    ("bfloat16", False, "native", "bfloat16"),
])
def test_vllm_dtype_is_bf16_on_bf16_hardware_only(requested, bf16_hardware, isa, expected, monkeypatch):
    monkeypatch.setattr(peers, "cpu_has_bf16", lambda: bf16_hardware)
    assert peers.vllm_dtype(requested, isa) == expected
