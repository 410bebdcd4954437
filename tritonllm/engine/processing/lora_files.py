"""Reading LoRA adapters from the adapters directory (PEFT's adapter_config.json + adapter_model.safetensors),
off the engine core's thread; the core gets a checked `LoraAdapter`.

This runs on Triton's thread, where no torch op may run (a second OpenMP team slows every engine step, see
tritonllm/engine/core/core_loop.py): the weights are read and scaled with numpy, and become tensors in the core's
LoRA slot pool."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from tritonllm.engine.core.prefix_keys import files_digest
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.lora_names import CONFIG_FILE, resolve_adapter
from tritonllm.engine.layers.lora import LoraAdapter, projection_shapes

WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight")


class AdapterDirectory:
    """The configured adapters directory: resolving a request's adapter and reading its files."""

    def __init__(self, directory: str | Path, arch, max_rank: int):
        self.root = Path(directory).resolve()
        if not self.root.is_dir():
            raise ValueError(f"lora_dir {directory} is not a directory")
        self.num_layers = arch.num_layers
        self.shapes = projection_shapes(arch)
        self.max_rank = max_rank

    def resolve(self, lora_path: str) -> str:
        return resolve_adapter(self.root, lora_path)

    def load(self, name: str) -> LoraAdapter:
        """Read and check an adapter's files; every problem is an InvalidRequest naming it."""
        folder = self.root / name
        try:
            config = json.loads((folder / CONFIG_FILE).read_text())
            rank = int(config["r"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise InvalidRequest(f"LoRA adapter {name!r}: unreadable {CONFIG_FILE} ({error})", "lora_path") from None
        unsupported = [key for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save")
                       if config.get(key)] + (["bias"] if config.get("bias", "none") != "none" else [])
        if unsupported:
            raise InvalidRequest(f"LoRA adapter {name!r} uses {', '.join(unsupported)}, which this server does "
                                 "not support", "lora_path")
        if not 1 <= rank <= self.max_rank:
            raise InvalidRequest(f"LoRA adapter {name!r} has rank {rank}; this server accepts ranks up to "
                                 f"max_lora_rank={self.max_rank}", "lora_path")
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        try:
            tensors = read_float32_safetensors(folder / WEIGHTS_FILE)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as error:  # missing, corrupt or odd file
            raise InvalidRequest(f"LoRA adapter {name!r}: unreadable {WEIGHTS_FILE} ({error})", "lora_path") from None
        return LoraAdapter(name, rank, self._pair_weights(name, tensors, rank, scaling), files_digest(folder))

    def _pair_weights(self, name: str, tensors: dict[str, np.ndarray], rank: int,
                      scaling: float) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
        halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for key, tensor in tensors.items():
            match = _PEFT_KEY.fullmatch(key)
            if match is None:
                raise InvalidRequest(f"LoRA adapter {name!r} has a tensor this server cannot apply: {key}", "lora_path")
            layer, projection = int(match.group(1)), f"{match.group(2)}_proj"
            halves.setdefault((layer, projection), {})[match.group(3)] = tensor
        weights = {}
        for (layer, projection), pair in halves.items():
            in_features, out_features = self.shapes[projection]
            a, b = pair.get("A"), pair.get("B")
            if layer >= self.num_layers or a is None or b is None or a.shape != (rank, in_features) \
                    or b.shape != (out_features, rank):
                raise InvalidRequest(f"LoRA adapter {name!r} does not fit this model at layer {layer} {projection} "
                                     f"(expected A {(rank, in_features)} and B {(out_features, rank)})", "lora_path")
            weights[(layer, projection)] = (a, b * np.float32(scaling))
        if not weights:
            raise InvalidRequest(f"LoRA adapter {name!r} has no LoRA weights", "lora_path")
        return weights


_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bf16: the high half of a float32


def read_float32_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every floating-point tensor of a safetensors file as float32 numpy arrays. The format: an 8-byte
    little-endian header length, a JSON header (dtype, shape, data_offsets per tensor), then the data."""
    data = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + header_len])
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {key} has dtype {entry['dtype']}; LoRA weights are F32, F16 or BF16")
        start, end = entry["data_offsets"]
        raw = np.frombuffer(data, _FLOAT_DTYPES[entry["dtype"]], offset=8 + header_len + start,
                            count=(end - start) // np.dtype(_FLOAT_DTYPES[entry["dtype"]]).itemsize)
        values = (raw.astype(np.uint32) << 16).view(np.float32) if entry["dtype"] == "BF16" else raw.astype(np.float32)
        tensors[key] = values.reshape(entry["shape"])
    return tensors
