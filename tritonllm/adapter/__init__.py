"""OpenAI-compatible HTTP API (legacy /v1/completions) in front of the decoupled Triton model `llm`."""

from tritonllm.adapter.app import create_app, run
from tritonllm.adapter.settings import AdapterSettings

__all__ = ["AdapterSettings", "create_app", "run"]
