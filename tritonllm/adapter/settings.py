"""Configuration of the OpenAI adapter, declared once: `python -m tritonllm.adapter` and `tritonllm serve` make
their options (with env vars and help) from these fields."""

from dataclasses import dataclass

from tritonllm.interface.api_key import read_api_key
from tritonllm.interface.settings import setting


@dataclass(frozen=True, kw_only=True)
class AdapterSettings:
    served_model_name: str
    """The model name clients must send; also the first entry of /v1/models."""
    triton_url: str = setting("127.0.0.1:8001", "tritonserver gRPC host:port")
    triton_model: str = setting("llm", "name of the Triton model")
    idle_timeout_s: float = setting(600.0, "seconds a Triton call may go without a response (no new token: 504)",
                                    option="idle-timeout")
    request_timeout_s: float | None = setting(None, "deadline in seconds of a whole generation request (504 beyond); "
                                                    "unset: none. A request's X-Request-Timeout header may shorten "
                                                    "it", option="request-timeout")
    shutdown_grace_s: float = setting(30.0, "on SIGTERM, seconds the requests in flight may take to finish "
                                            "before they are cancelled (new ones get 503 meanwhile)",
                                      option="shutdown-grace")
    health_timeout_s: float = setting(2.0, "seconds /health may wait for Triton's readiness answers",
                                      option="health-timeout")
    api_key: str | None = setting(None, "require 'Authorization: Bearer <key>' on the API routes (/v1, /tokenize, "
                                  "/detokenize, /invocations) and a header derived from it on Triton's own (all "
                                  "but health); unset: no auth. A command line shows in ps: prefer the variable "
                                  "or --api-key-file", secret=True)
    api_key_file: str | None = setting(None, "read the API key from this file (e.g. a mounted Secret)")
    metrics_require_key: bool = setting(False, "/metrics requires the API key too (/health never does)")
    max_body_bytes: int = setting(4 * 1024 * 1024, "largest request body in bytes (413 beyond)")
    max_prompts: int = setting(64, "prompts in one batched request (each becomes its own Triton request)")
    max_n: int = setting(16, "largest n")
    max_best_of: int = setting(16, "largest best_of")
    max_tokens: int | None = setting(None, "largest max_tokens (unset: only the context length limits it)")
    lora_dir: str | None = setting(None, "the engine's LoRA adapters directory (the same path): enables "
                                         "'<model>:<adapter>' and lora_path, and /v1/models lists its adapters")
    allow_runtime_lora: bool = setting(False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; "
                                              "adapters inside --lora-dir; also on with "
                                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
    triton_metrics_url: str | None = setting(None, "tritonserver's metrics endpoint, e.g. "
                                                   "http://127.0.0.1:8002/metrics (engine load, loaded adapters)")

    def __post_init__(self) -> None:
        # The key, read once; a keyed /metrics without a key would be open while it claims not to be.
        object.__setattr__(self, "api_key", read_api_key(self.api_key, self.api_key_file))
        object.__setattr__(self, "api_key_file", None)
        if self.metrics_require_key and self.api_key is None:
            raise ValueError("--metrics-require-key needs an API key (--api-key-file or TRITONLLM_API_KEY)")
