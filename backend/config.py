"""Engine configuration: one dataclass, filled from config.pbtxt parameters (strings) or keyword arguments."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '2e9' or 1073741824 → bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 1GiB, 512MiB, 2000000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass
class EngineConfig:
    model_path: str = ""  # HF directory or GGUF file; empty = the default model
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto = cuda when available
    kv_cache_memory: int = 1 << 30  # bytes for the paged KV pool
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences in the running batch
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_queue_len: int = 256  # requests waiting for admission before new ones are refused
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    lora_dir: str = ""  # directory of PEFT LoRA adapters (one per subdirectory); empty = LoRA disabled
    max_loras: int = 4  # adapters resident at once (the slot pool); more wait for a slot
    max_lora_rank: int = 16  # largest adapter rank accepted (sizes the slot pool)
    max_hidden_states_tokens: int = 4096  # hidden-state rows one request may ask for (choices × tokens)

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "EngineConfig":
        """Build from Triton model parameters; unknown keys are ignored, empty values keep the default."""
        kwargs = {}
        for field in dataclasses.fields(cls):
            raw = values.get(field.name)
            if raw is None or str(raw).strip() == "":
                continue
            raw = str(raw).strip()
            if field.name == "kv_cache_memory":
                kwargs[field.name] = parse_size(raw)
            elif field.type in ("int", int):
                kwargs[field.name] = int(raw)
            elif field.type in ("bool", bool):
                kwargs[field.name] = raw.lower() in ("1", "true", "yes", "on")
            else:
                kwargs[field.name] = raw
        return cls(**kwargs)
