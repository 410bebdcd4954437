"""The engine with every op forced onto its Triton kernel (interpreted on CPU) generates what the torch path does."""

from __future__ import annotations

import kernels
from backend.config import EngineConfig
from backend.llm_engine import LLMEngine
from backend.interface.parameters import SamplingParams
from engine_helpers import generate  # tests/ is on sys.path: tests/conftest.py's directory

PROMPTS = ["The capital of France is", "def add(a, b):"]


def test_greedy_generation_matches_torch_path(default_model_dir):
    engine = LLMEngine(EngineConfig(model_path=str(default_model_dir), dtype="float32", weight_format="float32",
                                    kv_cache_memory=16 << 20))
    # two prompts: one prefill step with two chunks, then batched decodes; a penalty runs the sampling kernel
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    expected = [r.token_ids() for r in generate(engine, PROMPTS, params)]
    kernels.force("1")
    try:
        assert [r.token_ids() for r in generate(engine, PROMPTS, params)] == expected
    finally:
        kernels.force("")
