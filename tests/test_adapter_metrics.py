"""The adapter's /metrics: Prometheus text, open without the API key, counting requests by route and status."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from stack_helpers import free_ports
from openai_adapter import AdapterSettings, create_app

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
