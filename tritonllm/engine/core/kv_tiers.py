"""The KV cache's lower tiers, below the device pool (block_manager.py): a byte-bounded pool of host memory that
keeps the full blocks the device pool evicts, least recently used out.

A prefix match runs device → host: the block manager takes a device block for each host hit and copies the
block's K/V into it while it schedules, so the step that needs them finds them in place. Copies are exact (the
same dtype, the same bytes), so a hit gives the output a cold run gives. Everything here runs on the core's
thread."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from tritonllm.engine.config import AUTO


def host_tier_bytes(setting: int | str, device: torch.device, device_pool_bytes: int) -> int:
    """kv_host_memory resolved: auto is off on the CPU, where the device pool is host memory already, and twice
    the device pool on CUDA."""
    if setting != AUTO:
        return int(setting)
    return 0 if device.type == "cpu" else 2 * device_pool_bytes


class DeviceBlocks:
    """Whole blocks of the device pool, every layer's keys and values, as one [2 × layers, block, heads, dim]
    tensor."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.caches = [cache for pair in kv_caches for cache in pair]  # k0, v0, k1, v1, ...
        self.shape = (len(self.caches), *self.caches[0].shape[1:])
        self.dtype = self.caches[0].dtype
        self.device = self.caches[0].device
        self.bytes_per_block = math.prod(self.shape) * self.dtype.itemsize

    def read_into(self, block: int, out: torch.Tensor) -> None:
        """Copy a block into a host tensor (on CUDA asynchronously, ordered with the steps on the stream)."""
        if out.device == self.device:
            torch.stack([cache[block] for cache in self.caches], out=out)
        else:
            out.copy_(torch.stack([cache[block] for cache in self.caches]), non_blocking=True)

    def write(self, block: int, kv: torch.Tensor) -> None:
        kv = kv.to(self.device, non_blocking=True)
        for cache, part in zip(self.caches, kv):
            cache[block].copy_(part)


class HostTier:
    """Blocks in a preallocated slab of host memory (pinned on CUDA), least recently used first out."""

    def __init__(self, capacity: int, blocks: DeviceBlocks):
        self.num_slots = capacity // blocks.bytes_per_block
        if self.num_slots < 1:
            raise ValueError(f"kv_host_memory={capacity} bytes is less than one KV block "
                             f"({blocks.bytes_per_block} bytes)")
        self.blocks = blocks
        self.slab = torch.empty(self.num_slots, *blocks.shape, dtype=blocks.dtype,
                                pin_memory=blocks.device.type == "cuda")
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key → slot, least recently used first
        self.tokens: list[tuple[int, ...] | None] = [None] * self.num_slots
        self.free_slots = list(range(self.num_slots))

    def touch(self, key: bytes) -> bool:
        """Whether this tier holds `key`; if so it becomes the most recently used."""
        if key not in self.slots:
            return False
        self.slots.move_to_end(key)
        return True

    def put(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        """Keep a device block that is about to be reused."""
        if key in self.slots:
            self.slots.move_to_end(key)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            _, slot = self.slots.popitem(last=False)
        self.blocks.read_into(block, self.slab[slot])
        self.slots[key] = slot
        self.tokens[slot] = tokens

    def load(self, key: bytes, tokens: tuple[int, ...], block: int) -> bool:
        """Copy the block of `key` into a device block; False when this tier does not hold it."""
        slot = self.slots.get(key)
        if slot is None or self.tokens[slot] != tokens:
            return False
        self.slots.move_to_end(key)
        self.blocks.write(block, self.slab[slot])
        return True
