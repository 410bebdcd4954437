"""Which model class serves a checkpoint: HF config.json's `model_type` → our class. Adding an architecture is
one file under models/ and one entry here."""

from __future__ import annotations

from pathlib import Path

import torch

from tritonllm.engine.models.architecture import read_hf_config
from tritonllm.engine.models.llama import LlamaForCausalLM
from tritonllm.engine.models.mixtral import MixtralForCausalLM
from tritonllm.engine.models.qwen3 import Qwen3ForCausalLM
from tritonllm.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from tritonllm.engine.models.weights import GgufBlocks, read_gguf_blocks
from tritonllm.model_files import BLOCKS_FILE, linked_gguf

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(model_type: str | None) -> type[LlamaForCausalLM]:
    if model_type not in MODELS:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(MODELS)})")
    return MODELS[model_type]


def from_pretrained(model_dir: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The model of an HF-format directory, built by the class its config.json's model_type names."""
    config = read_hf_config(model_dir)
    return model_class(config.get("model_type")).from_pretrained(model_dir, config, dtype, device)


def load_for_cpu(model_dir: Path, quantization: str = "none") -> tuple[LlamaForCausalLM, GgufBlocks | None]:
    """The model of a prepared directory in float32 on the CPU, with the GGUF blocks the kernels run: read from the
    linked GGUF file itself (those projections without dense weights), or from a converted one's directory; or an
    HF checkpoint's projections quantized at load (quantization: a config.QUANTIZATIONS other than none)."""
    config = read_hf_config(model_dir)
    cls = model_class(config.get("model_type"))
    gguf_path = linked_gguf(model_dir)
    if quantization != "none":
        if gguf_path is not None or (Path(model_dir) / BLOCKS_FILE).is_file():
            raise ValueError(f"quantization {quantization} is for HF checkpoints: {Path(model_dir).name} is a GGUF, "
                             "which runs on its own blocks (leave quantization none)")
        return cls.from_quantized(model_dir, config, quantization)
    if gguf_path is not None:
        return cls.from_gguf(gguf_path, config)
    model = cls.from_pretrained(model_dir, config, torch.float32, torch.device("cpu"))
    return model, read_gguf_blocks(model_dir, model.arch)
