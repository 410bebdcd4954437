"""Session fixtures: the prepared default model, a running `tritonllm serve` stack on free ports, and the official
openai SDK pointed at it; per module, a tiny random model of the module's `model_type`, its transformers twin and
an engine serving it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.model_files import prepare_default_model
from lora_helpers import write_random_adapter
from stack_helpers import (EXACT_OPTIONS, STACK_LORA_ADAPTERS, STACK_MAX_NUM_SEQS, STACK_MAX_QUEUE_LEN, Stack,
                           StackProcess, check_stack_survived, running_stack)
from tiny_models import write_tiny_model

if TYPE_CHECKING:  # transformers' modeling code imports triton: not before tests/kernels/conftest.py picks its mode
    from transformers import PreTrainedModel

STACK_KV_CACHE_MEMORY = "128MiB"  # ~2,900 tokens of SmolLM2-135M KV in float32: keeps the test stack light


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def stack_lora_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small random adapters for the stack, written once per session (a fraction of a second)."""
    root = tmp_path_factory.mktemp("lora")
    for seed, name in enumerate(STACK_LORA_ADAPTERS, start=1):
        write_random_adapter(root / name, default_model_dir, seed=seed, std=0.04)
    return root


@pytest.fixture(scope="session")
def stack_process(default_model_dir: Path, stack_lora_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProcess]:
    with running_stack(default_model_dir, tmp_path_factory.mktemp("stack"), *EXACT_OPTIONS,
                       "--kv-cache-memory", STACK_KV_CACHE_MEMORY,
                       "--max-num-seqs", str(STACK_MAX_NUM_SEQS), "--max-queue-len", str(STACK_MAX_QUEUE_LEN),
                       "--lora-dir", str(stack_lora_dir), "--max-loras", "1", "--allow-runtime-lora", "true",
                       lora_dir=stack_lora_dir) as started:
        yield started


@pytest.fixture(scope="session")
def stack(stack_process: StackProcess) -> Stack:
    """The shared stack's addresses; they stay the same if it is restarted after a test killed it."""
    return stack_process.stack


@pytest.fixture(autouse=True)
def _stack_survives(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test during which the shared stack died fails with the server's log instead of every later test
    failing with connection errors."""
    yield
    if "stack" in request.fixturenames:
        check_stack_survived(request.getfixturevalue("stack_process"))


@pytest.fixture(scope="session")
def client(stack: Stack) -> openai.OpenAI:
    """The official SDK on the stack's OpenAI API."""
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def complete(stack: Stack, client: openai.OpenAI):
    """client.completions.create with the served model filled in."""
    return lambda **kwargs: client.completions.create(model=stack.model_name, **kwargs)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path, model_type: str) -> Path:
    """A tiny random checkpoint of `model_type`, a fixture the test module parametrizes."""
    return write_tiny_model(tmp_path_factory.mktemp(model_type) / f"tiny-{model_type}", default_model_dir, model_type)


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir: Path) -> PreTrainedModel:
    """transformers' own model of the tiny checkpoint."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path):
    """An exact engine serving the tiny checkpoint; block_size 4 and a 16-token budget: prompts span several blocks
    and prefill in chunks."""
    # imported on use: the engine imports `kernels`, which tests/kernels/conftest.py must configure first
    from tritonllm.engine.llm_engine import LLMEngine
    from engine_helpers import EXACT
    return LLMEngine(EngineConfig(model_path=str(tiny_dir), **EXACT, kv_cache_memory=4 << 20, block_size=4,
                                  max_num_batched_tokens=16))
