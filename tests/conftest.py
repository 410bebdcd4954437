"""Session fixtures: the prepared default model, a running `tritonllm serve` stack on free ports, and the official
openai SDK pointed at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from backend.model_files import prepare_default_model
from lora_helpers import write_random_adapter
from stack_helpers import (EXACT_OPTIONS, STACK_LORA_ADAPTERS, STACK_MAX_NUM_SEQS, STACK_MAX_QUEUE_LEN, Stack,
                           StackProcess, check_stack_survived, running_stack)

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
                       "--lora-dir", str(stack_lora_dir), "--max-loras", "1", lora_dir=stack_lora_dir) as started:
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
