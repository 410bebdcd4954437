"""What the package asks of its environment: the adapter alone installs and serves with numpy 2 (only the
tritonserver wheel of the `local` extra caps numpy below 2), and the engine runs beside the newest transformers and
Hugging Face's own `kernels` package (whose import name ours once shadowed)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from stack_helpers import REPO_ROOT, free_ports

INSTALL_TIMEOUT_S = 600  # pip from the registry; ~30 s on a warm cache
ADAPTER_START_TIMEOUT_S = 60


def _clean_env() -> dict[str, str]:
    """This environment without the test run's PYTHONPATH: the venv must import what it installed."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}


@pytest.fixture(scope="module")
def adapter_venv(tmp_path_factory) -> Path:
    """A fresh venv with `tritonllm[adapter]` and numpy ≥ 2, installed from a copy of the source (a build in the
    tree would write build/ and *.egg-info there); its python."""
    root = tmp_path_factory.mktemp("adapter-venv")
    source = root / "source"
    source.mkdir()
    shutil.copy(REPO_ROOT / "pyproject.toml", source)
    shutil.copytree(REPO_ROOT / "tritonllm", source / "tritonllm", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", f"{source}[adapter]", "numpy>=2"],
                               env=_clean_env(), capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


def _venv_run(python: Path, code: str, cwd: Path) -> str:
    done = subprocess.run([str(python), "-c", code], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def test_the_adapter_alone_runs_with_numpy_2(adapter_venv, stack, client, tmp_path):
    """The adapter of a numpy-2 venv (no torch) in front of the test stack's tritonserver, as docker-compose.yml
    runs them: its tensors go out and come back through tritonclient with numpy 2, and it answers as the stack's
    own adapter does."""
    assert _venv_run(adapter_venv, "import numpy; print(numpy.__version__.split('.')[0])", tmp_path) == "2"
    assert _venv_run(adapter_venv, "import importlib.util; print(importlib.util.find_spec('torch'))", tmp_path) \
        == "None"
    port = free_ports(1)[0]
    adapter = subprocess.Popen(
        [str(adapter_venv), "-m", "tritonllm.adapter", "--served-model-name", stack.model_name,
         "--triton-url", stack.grpc_url, "--port", str(port)],
        cwd=tmp_path, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ADAPTER_START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert adapter.poll() is None and time.monotonic() < deadline, "the numpy-2 adapter did not start"
            time.sleep(0.3)
        numpy2 = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [model.id for model in numpy2.models.list()] == [stack.model_name]
        request = dict(model=stack.model_name, prompt="The capital of France is", max_tokens=8, temperature=0,
                       logprobs=2)
        through_numpy2, through_stack = numpy2.completions.create(**request), client.completions.create(**request)
        assert through_numpy2.choices[0].text == through_stack.choices[0].text != ""
        assert through_numpy2.choices[0].logprobs.top_logprobs == through_stack.choices[0].logprobs.top_logprobs
    finally:
        adapter.send_signal(signal.SIGTERM)
        try:
            adapter.wait(30)
        except subprocess.TimeoutExpired:
            adapter.kill()
            adapter.wait()


def test_the_engine_runs_beside_huggingface_kernels_and_the_newest_transformers():
    """`import kernels` is Hugging Face's package (transformers ≥ 5.25 imports it in transformers.activations), not
    ours, even from the repository root; and transformers and our engine load in one process. The stack tests serve
    their requests in this same environment (transformers ≥ 5.25 beside Hugging Face's kernels)."""
    code = """
import sys
import transformers.activations
import kernels
from tritonllm.engine.llm_engine import LLMEngine
import tritonllm.kernels
assert sys.modules["kernels"] is kernels and hasattr(kernels, "get_kernel"), kernels
print(kernels.__file__)
print(tritonllm.kernels.__file__)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    hf_kernels, ours = done.stdout.split()
    assert Path(hf_kernels).resolve() == Path(importlib.metadata.distribution("kernels").locate_file(
        "kernels/__init__.py")).resolve()
    assert Path(ours).resolve() == REPO_ROOT / "tritonllm" / "kernels" / "__init__.py"
    transformers_version = tuple(int(part) for part in importlib.metadata.version("transformers").split(".")[:2])
    assert transformers_version >= (5, 25)
