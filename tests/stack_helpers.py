"""Shared by the tests (a module, not conftest.py: tests/kernels has a conftest of its own, so `conftest` is
ambiguous as a module name): starting a `tritonllm serve` stack, ports, the test stack's limits, its engine
state read from the metrics, and tritonclient calls of the Triton model."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tritonllm.launcher import answers_ok, log_tail
from tritonllm.model_files import served_model_name

REPO_ROOT = Path(__file__).resolve().parent.parent
STACK_START_TIMEOUT_S = 180
STACK_MAX_NUM_SEQS = 8  # small limits so the overload test reaches them with few clients
STACK_MAX_QUEUE_LEN = 8
STACK_LORA_ADAPTERS = ("alpha", "beta")  # served with --max-loras 1: using both evicts one
# Stacks whose outputs are compared with transformers run in float32 whatever the machine would pick.
EXACT_OPTIONS = ("--dtype", "float32", "--weight-format", "float32", "--prefill-dtype", "float32")


@dataclass(frozen=True)
class Stack:
    base_url: str  # OpenAI API root, e.g. http://127.0.0.1:PORT/v1
    grpc_url: str  # tritonserver gRPC as tritonclient.grpc wants it: 127.0.0.1:PORT
    http_url: str  # tritonserver HTTP as tritonclient.http wants it: 127.0.0.1:PORT
    metrics_url: str  # Prometheus endpoint: http://127.0.0.1:PORT/metrics
    model_name: str  # the served model name for the `model` field
    state_dir: Path  # runtime repository, tritonserver.log and serve.log
    lora_dir: Path | None  # the LoRA adapters directory it serves, if any


class StackProcess:
    """A `tritonllm serve` process on fixed ports that can be checked and restarted on the same ports, so a test
    that kills tritonserver fails alone and the next test gets a fresh stack."""

    def __init__(self, model: Path | str, state_dir: Path, options: tuple[str, ...], lora_dir: Path | None):
        adapter_port, http_port, grpc_port, metrics_port = free_ports(4)
        self.state_dir = state_dir
        self.command = [
            sys.executable, "-m", "tritonllm", "serve", "--model", str(model), *options,
            "--port", str(adapter_port), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port), "--state-dir", str(state_dir),
        ]
        self.stack = Stack(
            base_url=f"http://127.0.0.1:{adapter_port}/v1",
            grpc_url=f"127.0.0.1:{grpc_port}",
            http_url=f"127.0.0.1:{http_port}",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            model_name=served_model_name(model) if isinstance(model, Path) else model,  # a hub id: as given
            state_dir=state_dir,
            lora_dir=lora_dir,
        )
        self.process: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Start `tritonllm serve`, its output appended to serve.log; start() also waits for its health."""
        with open(self.state_dir / "serve.log", "ab") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def start(self) -> None:
        self.spawn()
        deadline = time.monotonic() + STACK_START_TIMEOUT_S
        health = self.stack.base_url.removesuffix("/v1") + "/health"
        while not answers_ok(health):
            if self.process.poll() is not None or time.monotonic() > deadline:
                problem = f"exited with {self.process.returncode}" if self.process.poll() is not None else "timed out"
                self.stop()
                pytest.fail(f"tritonllm serve {problem}; {self.logs()}")
            time.sleep(0.5)

    def alive(self) -> bool:
        """`tritonllm serve` runs and its tritonserver answers (serve exits soon after tritonserver dies)."""
        return (self.process is not None and self.process.poll() is None
                and answers_ok(f"http://{self.stack.http_url}/v2/health/live"))

    def logs(self) -> str:
        return (f"serve.log tail:\n{log_tail(self.state_dir / 'serve.log', 60)}\n"
                f"tritonserver.log tail:\n{log_tail(self.state_dir / 'tritonserver.log', 60)}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def running_stack(model: Path | str, state_dir: Path, *options: str, lora_dir: Path | None = None
                  ) -> Iterator[StackProcess]:
    """`tritonllm serve --model model options...` (a model directory, or a hub id) on free ports, until the block
    exits (then SIGTERM)."""
    process = StackProcess(model, state_dir, options, lora_dir)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def check_stack_survived(process: StackProcess) -> None:
    """After a test: fail it with the logs when its stack died, and restart the stack for the next test."""
    if process.alive():
        return
    time.sleep(1)  # let serve notice and write its last lines
    logs = process.logs()
    process.stop()
    process.start()
    pytest.fail(f"the stack died during this test (restarted for the next one); {logs}")


def free_ports(count: int) -> list[int]:
    """Distinct ports free right now (all sockets held until each is picked, so no duplicates)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _children_by_parent() -> dict[int, list[int]]:
    """Every process's children, from one pass over /proc (a pass per process of a tree cost a sampling loop
    several percent of the CPU it was measuring)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
        except (OSError, IndexError, ValueError):  # a process that just ended
            continue
    return children


def child_pids(pid: int) -> list[int]:
    return _children_by_parent().get(pid, [])


def descendant_pids(pid: int) -> list[int]:
    children = _children_by_parent()
    found = list(children.get(pid, []))
    for descendant in found:  # (grows as it goes: breadth first)
        found.extend(children.get(descendant, []))
    return found


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def program_name(pid: int) -> str:
    """The executable's name, or "" once the process is gone (it may exit between a listing and this read)."""
    argv = command_line(pid)
    return Path(argv[0]).name if argv else ""


def free_port_range(count: int) -> int:
    """The first of `count` consecutive ports free right now."""
    for base in random.Random().sample(range(20000, 60000, 100), 50):
        try:
            sockets = []
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def metric(stack, name: str) -> float:
    text = httpx.get(stack.metrics_url, timeout=5).text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


def wait_until_idle(stack, timeout: float = 20.0) -> None:
    """The engine has nothing running or waiting and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        values = [metric(stack, f"tritonllm:{n}") for n in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks", "kv_cache_total_blocks")]
        if values[0] == 0 and values[1] == 0 and values[2] == values[3] > 0:
            return
        assert time.monotonic() < deadline, f"engine not idle: running, waiting, free, total = {values}"
        time.sleep(0.25)


def grpc_inputs(prompt: str, params: dict | str, stream: bool, flags: dict[str, bool]) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t
    raw = params if isinstance(params, str) else json.dumps(params)
    inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream]), "BOOL"),
              tensor("sampling_parameters", np.array([raw.encode()], dtype=np.object_), "BYTES")]
    flags = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
             **flags}
    inputs += [tensor(flag, np.array([value]), "BOOL") for flag, value in flags.items()]
    return inputs


def grpc_generate(stack, prompt: str, params: dict | str, stream: bool, headers: dict[str, str] | None = None,
                  **flags: bool) -> tuple[list, Exception | None]:
    """One request on its own gRPC stream: (responses carrying outputs, error or None). `flags` are more BOOL
    inputs (e.g. return_logprobs=True, exclude_input_in_output=False); `headers` go with the stream."""
    return grpc_stream(stack, grpc_inputs(prompt, params, stream, flags), headers)


def grpc_stream(stack, inputs: list, headers: dict[str, str] | None = None) -> tuple[list, Exception | None]:
    """`inputs` as one request on its own gRPC stream: (responses carrying outputs, error or None)."""
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)), headers=headers)
    try:
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
    except InferenceServerException:  # the stream was refused at once (e.g. no API key): the callback says why
        pass
    responses = []
    try:
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                return responses, error
            if result.get_response().outputs:
                responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses, None
    finally:
        client.stop_stream()
        client.close()
