"""Configuration of the OpenAI adapter."""

from dataclasses import dataclass

API_KEY_ENV = "TRITONLLM_API_KEY"
"""Environment variable holding the API key, read by both `tritonllm serve` and `python -m openai_adapter`."""


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
    api_key: str | None = None
    """When set, every /v1 route requires `Authorization: Bearer <api_key>`; /health stays open."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body (413 beyond)."""
    max_prompts: int = 64
    """Prompts in one batched request: each becomes its own Triton request."""
    max_n: int = 16
    max_best_of: int = 16
    max_tokens: int | None = None
    """Largest accepted max_tokens; None leaves only the engine's context-length check."""
    lora_dir: str | None = None
    """The engine's LoRA adapters directory (the same path): enables `model: "<served>:<adapter>"` and
    `lora_path`, and /v1/models lists its adapters. None: LoRA is off."""
    triton_metrics_url: str | None = None
    """tritonserver's Prometheus endpoint: /v1/models reads which adapters are loaded from it."""
