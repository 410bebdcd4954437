"""The LoRA slot pool: up to `max_loras` adapters on the model's device, stacked per layer and fused projection
so one batched matmul serves every adapter of a batch (tritonllm/engine/layers/lora.py). Owned by the engine core."""

from __future__ import annotations

from collections import OrderedDict

import torch

from tritonllm.engine.layers.lora import FUSED_PROJECTIONS, LayerLora, LoraAdapter, projection_shapes


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

    def for_layers(self, token_slots: torch.Tensor, active_slots: tuple[int, ...]) -> list[LayerLora]:
        return [LayerLora(token_slots, active_slots, stacks) for stacks in self.layers]

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
            a[slot, block * R:block * R + r] = torch.from_numpy(lora_a).to(a.dtype)
            b[slot, offset:offset + lora_b.shape[0], block * R:block * R + r] = torch.from_numpy(lora_b).to(b.dtype)
        self.residents[slot] = adapter
