"""`--instances 2`: one tritonserver runs two engines; Triton spreads requests over both (each its own KV cache,
no prefix affinity), and each engine's metrics carry its instance name, on Triton's port and relayed by the
adapter (also as two entries of /v1/loads)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stack_helpers import running_stack

INSTANCES = ("llm_0_0", "llm_0_1")


def _per_instance(metrics_url: str, name: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=5).text
    return {sample.labels["instance"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def test_both_instances_serve_and_report_their_own_metrics(default_model_dir: Path, tmp_path: Path):
    with running_stack(default_model_dir, tmp_path, "--instances", "2", "--kv-cache-memory", "64MiB",
                       "--max-num-seqs", "4") as process:
        stack = process.stack
        body = {"model": stack.model_name, "max_tokens": 4, "temperature": 0}

        def complete(i: int) -> int:
            return httpx.post(f"{stack.base_url}/completions", json={**body, "prompt": f"Request {i}: hello"},
                              timeout=120).status_code

        # Triton gives a request to whichever instance takes it first: send bursts until both have served.
        with ThreadPoolExecutor(4) as pool:
            for burst in range(10):
                assert list(pool.map(complete, range(4 * burst, 4 * burst + 4))) == [200] * 4
                prompt_tokens = _per_instance(stack.metrics_url, "tritonllm:prompt_tokens_total")
                if sorted(prompt_tokens) == list(INSTANCES) and all(prompt_tokens.values()):
                    break
        assert sorted(prompt_tokens) == list(INSTANCES) and all(prompt_tokens.values()), prompt_tokens

        adapter_metrics = stack.base_url.removesuffix("/v1") + "/metrics"
        for name in ("tritonllm:num_requests_running", "tritonllm:num_requests_waiting", "tritonllm:kv_cache_usage"):
            assert sorted(_per_instance(adapter_metrics, name)) == list(INSTANCES), name
        loads = httpx.get(f"{stack.base_url}/loads", timeout=5).json()
        assert [load["dp_rank"] for load in loads["loads"]] == [0, 1]
