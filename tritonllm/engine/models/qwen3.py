"""Qwen3 (dense): Llama with an RMSNorm over each query and key head before the rotation; its head_dim is its
own (not hidden_size / heads), and it has no attention bias unless the config says so."""

from __future__ import annotations

from dataclasses import replace

from tritonllm.engine.models.architecture import ModelArchitecture
from tritonllm.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def architecture(cls, config: dict) -> ModelArchitecture:
        return replace(super().architecture(config), qk_norm=True)
