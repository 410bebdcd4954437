"""tritonllm: LLM serving for NVIDIA Triton Inference Server.

One import namespace: `tritonllm.engine` (the engine inside the decoupled Python-backend model), `tritonllm.kernels`
(its custom ops), `tritonllm.interface` (the torch-free contract it shares with the adapter), `tritonllm.adapter`
(the OpenAI-compatible HTTP service), and the `tritonllm` command (`cli`, `launcher`, `model_files`, `scale_out`,
`gateway`). Importing this package imports none of them."""
