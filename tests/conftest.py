"""Session fixtures: the prepared default model, and a running `tritonllm serve` stack on free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.model_files import prepare_default_model, served_model_name
from lora_helpers import write_random_adapter
from stack_helpers import REPO_ROOT, STACK_LORA_ADAPTERS, STACK_MAX_NUM_SEQS, STACK_MAX_QUEUE_LEN, free_ports

STACK_START_TIMEOUT_S = 180
STACK_KV_CACHE_MEMORY = "128MiB"  # ~2,900 tokens of SmolLM2-135M KV in float32: keeps the test stack light


@dataclass(frozen=True)
class Stack:
    base_url: str  # OpenAI API root, e.g. http://127.0.0.1:PORT/v1
    grpc_url: str  # tritonserver gRPC as tritonclient.grpc wants it: 127.0.0.1:PORT
    http_url: str  # tritonserver HTTP as tritonclient.http wants it: 127.0.0.1:PORT
    metrics_url: str  # Prometheus endpoint: http://127.0.0.1:PORT/metrics
    model_name: str  # the served model name for the `model` field
    state_dir: Path  # runtime repository, tritonserver.log and serve.log
    lora_dir: Path  # the LoRA adapters directory it serves (STACK_LORA_ADAPTERS)


def _tail(path: Path, lines: int = 60) -> str:
    try:
        with open(path, errors="replace") as file:
            return "".join(deque(file, maxlen=lines))
    except FileNotFoundError:
        return "(no log)"


def _answers_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


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
def stack(default_model_dir: Path, stack_lora_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state_dir = tmp_path_factory.mktemp("stack")
    adapter_port, http_port, grpc_port, metrics_port = free_ports(4)
    command = [
        sys.executable, "-m", "backend.cli", "serve",
        "--model", str(default_model_dir), "--kv-cache-memory", STACK_KV_CACHE_MEMORY,
        "--max-num-seqs", str(STACK_MAX_NUM_SEQS), "--max-queue-len", str(STACK_MAX_QUEUE_LEN),
        "--port", str(adapter_port), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--state-dir", str(state_dir),
        "--lora-dir", str(stack_lora_dir), "--max-loras", "1",
    ]
    serve_log = state_dir / "serve.log"
    with open(serve_log, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    adapter = f"http://127.0.0.1:{adapter_port}"
    try:
        deadline = time.monotonic() + STACK_START_TIMEOUT_S
        while not _answers_ok(adapter + "/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                problem = f"exited with {process.returncode}" if process.poll() is not None else "timed out"
                pytest.fail(f"tritonllm serve {problem}; serve.log tail:\n{_tail(serve_log)}\n"
                            f"tritonserver.log tail:\n{_tail(state_dir / 'tritonserver.log')}")
            time.sleep(0.5)
        yield Stack(
            base_url=adapter + "/v1",
            grpc_url=f"127.0.0.1:{grpc_port}",
            http_url=f"127.0.0.1:{http_port}",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            model_name=served_model_name(default_model_dir),
            state_dir=state_dir,
            lora_dir=stack_lora_dir,
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
