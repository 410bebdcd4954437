"""The adapter's /metrics: Prometheus text, open without the API key, counting requests by route and status, and
relaying the engines' own metrics; /v1/loads: the same load in SGLang's shape, for gateways."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fastapi.testclient import TestClient

from stack_helpers import free_ports
from tritonllm.adapter import AdapterSettings, create_app

KEY = "sk-test-key"


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}{{(.*)}} (\S+)", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            return float(match.group(2))
    return 0.0


def test_metrics_count_requests_by_route_and_status():
    settings = AdapterSettings(served_model_name="m", triton_url=f"127.0.0.1:{free_ports(1)[0]}", api_key=KEY,
                               request_timeout_s=5, health_timeout_s=0.5)
    with TestClient(create_app(settings)) as client:
        assert client.post("/v1/chat/completions", json={}).status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        assert client.post("/v1/chat/completions", json={"model": "m"}, headers=headers).status_code == 400
        assert client.get("/no/such/path").status_code == 404
        response = client.get("/metrics")  # no API key needed
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    route = "/v1/chat/completions"
    assert _sample(text, "tritonllm_adapter_requests_total", route=route, method="POST", status="401") == 1
    assert _sample(text, "tritonllm_adapter_requests_total", route=route, method="POST", status="400") == 1
    assert _sample(text, "tritonllm_adapter_requests_total", route="unmatched", status="404") == 1
    assert _sample(text, "tritonllm_adapter_request_duration_seconds_count", route=route) == 2
    # The /metrics request itself is the one in flight.
    assert re.search(r"^tritonllm_adapter_requests_in_flight 1\.0$", text, re.MULTILINE)


# Two engine instances, as tritonserver's metrics endpoint shows them (abridged).
TRITON_METRICS = """\
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="llm",version="1"} 7
# HELP tritonllm:num_requests_running Sequences in the running batch
# TYPE tritonllm:num_requests_running gauge
tritonllm:num_requests_running{instance="llm_0_1",model="llm",version="1"} 1
tritonllm:num_requests_running{instance="llm_0_0",model="llm",version="1"} 3
# HELP tritonllm:num_requests_waiting Sequences waiting for admission
# TYPE tritonllm:num_requests_waiting gauge
tritonllm:num_requests_waiting{instance="llm_0_1",model="llm",version="1"} 0
tritonllm:num_requests_waiting{instance="llm_0_0",model="llm",version="1"} 2
# HELP tritonllm:kv_cache_usage Fraction of KV cache blocks held by sequences
# TYPE tritonllm:kv_cache_usage gauge
tritonllm:kv_cache_usage{instance="llm_0_1",model="llm",version="1"} 0.125
tritonllm:kv_cache_usage{instance="llm_0_0",model="llm",version="1"} 0.5
# HELP tritonllm:prefix_cache_hit_rate Prompt tokens served from the prefix cache
# TYPE tritonllm:prefix_cache_hit_rate gauge
tritonllm:prefix_cache_hit_rate{instance="llm_0_1",model="llm",version="1"} 0.25
tritonllm:prefix_cache_hit_rate{instance="llm_0_0",model="llm",version="1"} 0
# HELP vllm:request_success_total Finished choices by finished_reason
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",instance="llm_0_0",model="llm",version="1"} 4
vllm:request_success_total{finished_reason="length",instance="llm_0_0",model="llm",version="1"} 2
# HELP vllm:e2e_request_latency_seconds Time from arrival to the last response
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{instance="llm_0_0",model="llm",version="1"} 6
vllm:e2e_request_latency_seconds_sum{instance="llm_0_0",model="llm",version="1"} 4.5
vllm:e2e_request_latency_seconds_bucket{instance="llm_0_0",model="llm",version="1",le="1"} 5
vllm:e2e_request_latency_seconds_bucket{instance="llm_0_0",model="llm",version="1",le="+Inf"} 6
"""


@contextmanager
def _triton_metrics_endpoint(text: str) -> Iterator[str]:
    """A stand-in for tritonserver's metrics port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def _settings(metrics_url: str) -> AdapterSettings:
    return AdapterSettings(served_model_name="m", triton_url=f"127.0.0.1:{free_ports(1)[0]}",
                           triton_metrics_url=metrics_url, request_timeout_s=5, health_timeout_s=0.5)


def test_metrics_relay_the_engines_own_metrics_under_their_own_names():
    """Gauges, counters (with their labels) and histograms as the engines export them: one scrape target for
    dashboards. tritonserver's own metrics are not the adapter's to repeat."""
    with _triton_metrics_endpoint(TRITON_METRICS) as url, TestClient(create_app(_settings(url))) as client:
        text = client.get("/metrics").text
    for name, labels, value in [("tritonllm:num_requests_running", {"instance": "llm_0_0"}, 3),
                                ("tritonllm:num_requests_waiting", {"instance": "llm_0_0"}, 2),
                                ("tritonllm:kv_cache_usage", {"instance": "llm_0_1"}, 0.125),
                                ("tritonllm:prefix_cache_hit_rate", {"instance": "llm_0_1"}, 0.25),
                                ("vllm:request_success_total", {"finished_reason": "stop"}, 4),
                                ("vllm:request_success_total", {"finished_reason": "length"}, 2),
                                ("vllm:e2e_request_latency_seconds_count", {}, 6),
                                ("vllm:e2e_request_latency_seconds_sum", {}, 4.5),
                                ("vllm:e2e_request_latency_seconds_bucket", {"le": "1"}, 5)]:
        assert _sample(text, name, model="llm", **labels) == value, name
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    assert "nv_inference_count" not in text


def test_loads_answer_in_sglangs_shape_one_entry_per_engine_instance():
    """What SMG polls (GET /v1/loads) for load-aware routing and overload protection."""
    with _triton_metrics_endpoint(TRITON_METRICS) as url, TestClient(create_app(_settings(url))) as client:
        loads = client.get("/v1/loads", params={"include": "core"}).json()
    assert loads["dp_rank_count"] == 2
    assert loads["loads"] == [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "token_usage": 0.5, "cache_hit_rate": 0.0},
        {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.125, "cache_hit_rate": 0.25},
    ]


def test_without_triton_metrics_loads_are_unavailable_and_metrics_still_answer():
    with TestClient(create_app(_settings(f"http://127.0.0.1:{free_ports(1)[0]}/metrics"))) as client:
        assert client.get("/v1/loads").status_code == 503
        response = client.get("/metrics")
    assert response.status_code == 200 and "tritonllm_adapter_requests_total" in response.text
    assert "tritonllm:num_requests_running" not in response.text


def test_health_is_red_while_an_engine_instance_is_dead(monkeypatch):
    """Triton calls the model ready while a dead engine refuses everything inside it: its gauge tells."""
    from tritonllm.adapter.triton_client import TritonClient

    async def ready(self) -> bool:
        return True

    monkeypatch.setattr(TritonClient, "is_ready", ready)
    gauge = "# TYPE tritonllm:engine_dead gauge\ntritonllm:engine_dead{{instance=\"{}\",model=\"llm\",version=\"1\"}} {}\n"
    healthy = TRITON_METRICS + gauge.format("llm_0_0", 0) + gauge.format("llm_0_1", 0)
    with _triton_metrics_endpoint(healthy) as url, TestClient(create_app(_settings(url))) as client:
        assert client.get("/health").status_code == 200
    dead = TRITON_METRICS + gauge.format("llm_0_0", 0) + gauge.format("llm_0_1", 1)
    with _triton_metrics_endpoint(dead) as url, TestClient(create_app(_settings(url))) as client:
        response = client.get("/health")
    assert response.status_code == 503
    error = response.json()["error"]
    assert "llm_0_1" in error["message"] and "llm_0_0" not in error["message"] and "dead" in error["message"]


def test_health_answers_at_once_while_serve_reports_an_engine_process_dead(monkeypatch):
    """While the model reloads, a probe of the dead instance waits out its timeout: /health does not ask it again
    (Kubernetes' probes time out after 1 s by default)."""
    from tritonllm.adapter.engine_health import EngineHealth
    from tritonllm.adapter.triton_client import TritonClient

    async def ready(self) -> bool:
        return True

    probes = []

    async def probe(self) -> None:
        probes.append(True)

    monkeypatch.setattr(TritonClient, "is_ready", ready)
    monkeypatch.setattr(TritonClient, "probe", probe)
    health = EngineHealth()
    with _triton_metrics_endpoint(TRITON_METRICS) as url, TestClient(create_app(_settings(url), health)) as client:
        assert client.get("/health").status_code == 200 and len(probes) == 1
        health.mark_dead("llm_0_0", "killed by SIGKILL")
        response = client.get("/health")
    assert response.status_code == 503 and "llm_0_0" in response.json()["error"]["message"]
    assert len(probes) == 1
