"""The `tritonllm` product command: it runs the Triton side (backend/) and the OpenAI adapter together."""
