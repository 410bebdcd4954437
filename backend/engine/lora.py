"""LoRA adapters: finding them in the adapters directory, reading PEFT files, and the slot pool the forward pass
reads them from.

An adapter is a subdirectory holding `adapter_config.json` and `adapter_model.safetensors` (PEFT's format); its
name is its path relative to the directory. The pool holds up to `max_loras` adapters on the model's device,
stacked per layer and (fused) projection so one batched matmul serves every adapter of a batch. The fused qkv
(gate_up) projection gets one stack: A is the q, k and v A matrices one above the other, B is block-diagonal,
so each sub-projection's update lands in its own slice of the fused output (untargeted blocks stay zero)."""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

import kernels

from backend.errors import InvalidRequest, NotFound

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# our fused projection → the checkpoint projections it concatenates, in order
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight")


def projection_shapes(arch) -> dict[str, tuple[int, int]]:
    """Checkpoint projection → (in features, out features) of a Llama architecture."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass
class LoraAdapter:
    name: str  # path relative to the adapters directory: the adapter's identity (prefix cache included)
    rank: int
    # (layer, checkpoint projection) → (A [rank, in], B [out, rank] with the scaling folded in), float32 on CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class AdapterDirectory:
    """The configured adapters directory: which adapters exist, and reading one."""

    def __init__(self, directory: str | Path, arch, max_rank: int):
        self.root = Path(directory).resolve()
        if not self.root.is_dir():
            raise ValueError(f"lora_dir {directory} is not a directory")
        self.num_layers = arch.num_layers
        self.shapes = projection_shapes(arch)
        self.max_rank = max_rank

    def available(self) -> list[str]:
        return sorted(path.parent.relative_to(self.root).as_posix() for path in self.root.rglob(CONFIG_FILE)
                      if path.parent != self.root)

    def resolve(self, lora_path: str) -> str:
        """An adapter name or a path inside the directory → the adapter's name. Symlinks and `..` are followed
        first, so nothing outside the directory is reachable."""
        try:
            candidate = (self.root / lora_path).resolve()
            inside = self.root in candidate.parents
            exists = inside and (candidate / CONFIG_FILE).is_file()
        except (OSError, ValueError):  # NUL bytes, or characters the file system encoding lacks: no such file
            inside, exists = True, False
        if not inside:
            raise InvalidRequest(f"lora_path {lora_path!r} is not inside the adapters directory", "lora_path")
        if not exists:
            raise NotFound(f"there is no LoRA adapter {lora_path!r} (available: {', '.join(self.available())})",
                           "lora_path")
        return candidate.relative_to(self.root).as_posix()

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
            with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
                tensors = {key: handle.get_tensor(key).float() for key in handle.keys()}
        except Exception as error:  # missing or corrupt file: safetensors raises several kinds
            raise InvalidRequest(f"LoRA adapter {name!r}: unreadable {WEIGHTS_FILE} ({error})", "lora_path") from None
        return LoraAdapter(name, rank, self._pair_weights(name, tensors, rank, scaling))

    def _pair_weights(self, name: str, tensors: dict[str, torch.Tensor], rank: int,
                      scaling: float) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
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
            weights[(layer, projection)] = (a, b * scaling)
        if not weights:
            raise InvalidRequest(f"LoRA adapter {name!r} has no LoRA weights", "lora_path")
        return weights


@dataclass
class LayerLora:
    """What one layer's projections need to apply the batch's adapters."""

    token_slots: torch.Tensor  # [tokens] int32: each token's slot, −1 = the base model
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # fused projection → (A stack, B stack)

    def delta(self, projection: str, x: torch.Tensor) -> torch.Tensor:
        """The update each token's adapter adds to the fused projection's output for input x."""
        lora_a, lora_b = self.weights[projection]
        return kernels.lora_delta(x, lora_a, lora_b, self.token_slots)


class LoraSlotPool:
    """`max_loras` adapter slots on the model's device, reused least recently used first. A slot in use by a
    running sequence is pinned: it is never evicted, so a sequence whose adapter finds no slot waits."""

    def __init__(self, arch, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_rank = max_rank
        shapes = projection_shapes(arch)
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(arch.num_layers):
            stacks = {}
            for fused, parts in FUSED_PROJECTIONS.items():
                in_features = shapes[parts[0]][0]
                out_features = sum(shapes[part][1] for part in parts)
                rank = len(parts) * max_rank
                stacks[fused] = (torch.zeros(max_loras, rank, in_features, dtype=dtype, device=device),
                                 torch.zeros(max_loras, out_features, rank, dtype=dtype, device=device))
            self.layers.append(stacks)
        # where each checkpoint projection sits in its fused stack: (fused, rank block, first output row)
        self.placement = {}
        for fused, parts in FUSED_PROJECTIONS.items():
            offset = 0
            for block, part in enumerate(parts):
                self.placement[part] = (fused, block, offset)
                offset += shapes[part][1]
        self.residents: list[LoraAdapter | None] = [None] * max_loras
        self.pins = [0] * max_loras
        self.recency: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))  # LRU first

    def resident(self, name: str) -> LoraAdapter | None:
        """The adapter if it is loaded (its weights are then already read)."""
        return next((adapter for adapter in self.residents if adapter is not None and adapter.name == name), None)

    def loaded_names(self) -> list[str]:
        return sorted(adapter.name for adapter in self.residents if adapter is not None)

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """Pin a slot holding the adapter, loading it (evicting the least recently used unpinned adapter) when
        needed; None when every slot is pinned."""
        slot = next((s for s, held in enumerate(self.residents) if held is not None and held.name == adapter.name),
                    None)
        if slot is None:
            slot = next((s for s in self.recency if self.pins[s] == 0), None)
            if slot is None:
                return None
            self._write(slot, adapter)
        self.pins[slot] += 1
        self.recency.move_to_end(slot)
        return slot

    def for_layers(self, token_slots: torch.Tensor) -> list[LayerLora]:
        return [LayerLora(token_slots, stacks) for stacks in self.layers]

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        for stacks in self.layers:
            for a, b in stacks.values():
                a[slot].zero_()
                b[slot].zero_()
        r, R = adapter.rank, self.max_rank
        for (layer, projection), (lora_a, lora_b) in adapter.weights.items():
            fused, block, offset = self.placement[projection]
            a, b = self.layers[layer][fused]
            a[slot, block * R:block * R + r] = lora_a.to(a.dtype)
            b[slot, offset:offset + lora_b.shape[0], block * R:block * R + r] = lora_b.to(b.dtype)
        self.residents[slot] = adapter
