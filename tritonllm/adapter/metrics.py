"""The adapter's own Prometheus metrics (requests by route and status, latency, in flight), served at /metrics
beside the engines' load gauges relayed from Triton (tritonllm/adapter/engine_metrics.py).

Measured by an ASGI middleware, so a streamed response counts until its last byte, not until its headers."""

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Unmatched paths share one label, so probing random URLs cannot grow the label set without bound.
_UNMATCHED_ROUTE = "unmatched"
# Generation requests take seconds to minutes; the default buckets stop at 10 s.
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class AdapterMetrics:
    """The metrics of one app, in a registry of their own (several apps may live in one process, e.g. tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tritonllm_adapter_requests", "HTTP requests by route, method and status",
            ["route", "method", "status"], registry=self.registry,
        )
        self.latency = Histogram(
            "tritonllm_adapter_request_duration_seconds", "HTTP request latency until the response's last byte",
            ["route", "method"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.in_flight = Gauge(
            "tritonllm_adapter_requests_in_flight", "HTTP requests being served", registry=self.registry
        )

    def response(self, relayed: list[Metric] = ()) -> Response:
        """The adapter's metrics, then the `relayed` families (read from elsewhere) as they are."""
        text = generate_latest(self.registry) + generate_latest(_Families(relayed))
        return Response(text, media_type=CONTENT_TYPE_LATEST)


class _Families:
    """A collector of families already read (what generate_latest renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return list(self.families)


class MetricsMiddleware:
    """Records every HTTP request in `AdapterMetrics`; a request that raises counts as status 500."""

    def __init__(self, app: ASGIApp, metrics: AdapterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def send_recording_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_recording_status)
        finally:
            self.metrics.in_flight.dec()
            # The router records the matched route in the scope; its path template is the label.
            route = getattr(scope.get("route"), "path", _UNMATCHED_ROUTE)
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.latency.labels(route, scope["method"]).observe(time.perf_counter() - started)
