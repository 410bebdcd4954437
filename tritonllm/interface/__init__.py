"""The contract between the OpenAI adapter and the Triton model, declared once and imported by both sides:
request parameters (`parameters`), error kinds (`errors`), tensor names (`tensors`) and LoRA adapter names
(`lora_names`). Torch-free: the adapter's image does not have torch."""
