"""Shared by the tests (a module, not conftest.py: tests/kernels has a conftest of its own, so `conftest` is
ambiguous as a module name): ports, the test stack's limits, its engine state read from the metrics, and
tritonclient calls of the Triton model."""

from __future__ import annotations

import json
import queue
import re
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient

REPO_ROOT = Path(__file__).resolve().parent.parent
STACK_MAX_NUM_SEQS = 8  # small limits so the overload test reaches them with few clients
STACK_MAX_QUEUE_LEN = 8
STACK_LORA_ADAPTERS = ("alpha", "beta")  # served with --max-loras 1: using both evicts one


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


def _grpc_inputs(prompt: str, params: dict | str, stream: bool) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t
    raw = params if isinstance(params, str) else json.dumps(params)
    inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream]), "BOOL"),
              tensor("sampling_parameters", np.array([raw.encode()], dtype=np.object_), "BYTES")]
    for flag in ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"):
        inputs.append(tensor(flag, np.array([True]), "BOOL"))
    return inputs


def grpc_generate(stack, prompt: str, params: dict | str, stream: bool) -> tuple[list, Exception | None]:
    """One request on its own gRPC stream: (responses carrying outputs, error or None)."""
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer("llm", _grpc_inputs(prompt, params, stream), enable_empty_final_response=True)
    responses, error = [], None
    try:
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                return responses, error
            if result.as_numpy("text_output") is not None:
                responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses, None
    finally:
        client.stop_stream()
        client.close()
