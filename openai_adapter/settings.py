"""Configuration of the OpenAI adapter."""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AdapterSettings:
    served_model_name: str
    """The model name clients must send; also the only entry of /v1/models."""
    triton_url: str = "127.0.0.1:8001"
    """host:port of tritonserver's gRPC endpoint."""
    triton_model: str = "llm"
    request_timeout_s: float = 600.0
    """Deadline of one Triton call (a whole generation, streamed or not)."""
    health_timeout_s: float = 2.0
    """How long /health may wait for Triton's readiness answers."""
