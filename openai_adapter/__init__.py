"""OpenAI-compatible HTTP API (legacy /v1/completions) in front of the decoupled Triton model `llm`."""

from openai_adapter.app import create_app, run
from openai_adapter.settings import AdapterSettings

__all__ = ["AdapterSettings", "create_app", "run"]
