"""tritonllm backend: the LLM engine that runs inside a decoupled Triton Python-backend model."""
