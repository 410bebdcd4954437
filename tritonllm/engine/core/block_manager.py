"""The paged KV block pool: allocation, reference counts and the automatic prefix cache.

A full block is keyed by a hash chain (parent block's key + its own tokens), so equal keys mean equal prefixes.
The chain starts from the model's identity, the sequence's LoRA adapter and its cache_salt (prefix_keys.py):
adapters never share KV, and requests share prefixes only with requests of the same salt.
Freed blocks that hold a cached prefix stay findable until they are reused (LRU order); with a host tier
(kv_tiers.py) a reused block's K/V move there first; with a storage tier every newly computed block is offered to
it. A prefix match goes on from the device pool into the host tier, then into storage; one that reaches storage
is matched again once the blocks are read (`PrefixRead`), with them: the sequence holds no block meanwhile (one
that held some while others wait for blocks could keep them all waiting)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from tritonllm.engine.core.kv_tiers import HostTier, StorageRead, StorageTier
from tritonllm.engine.core.prefix_keys import block_key, root_key
from tritonllm.engine.core.sequence import CachedTokens, Sequence


DEVICE, HOST, STORAGE = range(3)  # the tier a cached block came from: its index in CachedTokens.by_tier()


@dataclass(frozen=True)
class PrefixRead:
    """A sequence's prefix match waiting on storage: its full blocks' (key, tokens), the tier each of its first
    blocks came from (device pool, host memory: they stay in the device pool meanwhile), and the read of the
    blocks after them."""

    chain: list[tuple[bytes, tuple[int, ...]]]
    tiers: list[int]
    read: StorageRead


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, model: bytes = b"",
                 host: HostTier | None = None, storage: StorageTier | None = None):
        self.model = model  # the model's identity (prefix_keys.model_key): the root of every key
        self.host = host
        self.storage = storage
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        # free blocks, least recently used first: reuse takes from the front
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = CachedTokens()  # prompt tokens found there, by tier

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _root_key(self, seq: Sequence) -> bytes:
        """The parent key of a sequence's first block: the model, the sequence's adapter and its salt."""
        lora = seq.request.lora
        return root_key(self.model, None if lora is None else (lora.name, lora.files), seq.params.cache_salt)

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:  # evict its cached prefix (to the host tier, if there is one)
            if self.host is not None:
                self.host.put(key, self.block_tokens[block], block)
            del self.key_to_block[key]
            self.block_keys[block] = None
            self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def _reuse(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def allocate_cached_prefix(self, seq: Sequence) -> CachedTokens | PrefixRead:
        """Give a new sequence the cached blocks of its longest cached prefix, copying the ones found in host memory
        into device blocks; returns the tokens they hold, by tier. When storage may hold the blocks after them,
        starts reading those instead and returns the read, holding no block: `finish_prefix_read` matches the
        prefix again once it is done, with the blocks read.

        The last token is always left to compute, since its logits are needed to sample."""
        assert not seq.block_table
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs or seq.needs_prompt_hidden_states:
            return CachedTokens()
        chain = self.chain(seq, (seq.num_tokens - 1) // self.block_size)
        tiers = self._match(seq, chain, {})
        rest = chain[len(tiers):]
        if self.storage is not None and rest:  # (all of it: blocks may free up while it is read)
            read = self.storage.start_read(rest)
            self.free(seq)  # (the blocks it matched stay cached)
            return PrefixRead(chain, tiers, read)
        return self._count(seq, tiers)

    def finish_prefix_read(self, seq: Sequence, pending: PrefixRead) -> CachedTokens:
        """Give the sequence the cached blocks of its prefix once its storage read is done, copying the ones read
        into device blocks; returns the tokens they hold, by tier."""
        read = dict(zip((key for key, _ in pending.read.chain), self.storage.finish_read(pending.read)))
        tiers = self._match(seq, pending.chain, read)
        first = len(pending.tiers)  # (found again in the device pool, or host memory: they count where they came from)
        return self._count(seq, pending.tiers[:len(tiers)] + tiers[first:])

    def _match(self, seq: Sequence, chain: list[tuple[bytes, tuple[int, ...]]], read: dict[bytes, torch.Tensor]
               ) -> list[int]:
        """Give the sequence the blocks of the longest run of `chain` that the device pool, host memory or `read`
        (blocks read from storage) hold, in that order; the tier each came from (CachedTokens.by_tier's order)."""
        tiers = []
        for key, tokens in chain:
            if self._reuse_cached(seq, key, tokens):
                tiers.append(DEVICE)
            elif not self.free_blocks:
                break
            elif self.host is not None and (kv := self.host.take(key, tokens)) is not None:
                self._load(seq, key, tokens, kv, self.host)
                tiers.append(HOST)
            elif (kv := read.get(key)) is not None:
                self._load(seq, key, tokens, kv, self.storage)
                tiers.append(STORAGE)
            else:
                break
        return tiers

    def _count(self, seq: Sequence, tiers: list[int]) -> CachedTokens:
        """The tokens of the blocks that came from each tier, counted in the hit rates."""
        cached = CachedTokens(*(tiers.count(tier) * self.block_size for tier in (DEVICE, HOST, STORAGE)))
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += cached.within(seq.num_prompt_tokens)
        return cached

    def chain(self, seq: Sequence, num_blocks: int) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, tokens) of the sequence's first num_blocks full blocks."""
        chain, parent_key = [], self._root_key(seq)
        for i in range(num_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent_key = block_key(parent_key, tokens)
            chain.append((parent_key, tokens))
        return chain

    def _reuse_cached(self, seq: Sequence, key: bytes, tokens: tuple[int, ...]) -> bool:
        """Give the sequence the device pool's block of `key`, if the pool holds it."""
        block = self.key_to_block.get(key)
        if block is None or self.block_tokens[block] != tokens:
            return False
        self._reuse(block)
        self._append(seq, key, block)
        return True

    def _load(self, seq: Sequence, key: bytes, tokens: tuple[int, ...], kv: torch.Tensor,
              tier: HostTier | StorageTier) -> None:
        """Give the sequence a free block holding `kv`, the K/V of `key` that a lower tier held."""
        block = self._take_free_block()  # (may move another block to the host tier)
        tier.blocks.write(block, kv)
        self._register(key, tokens, block)
        self._append(seq, key, block)

    @staticmethod
    def _append(seq: Sequence, key: bytes, block: int) -> None:
        seq.block_table.append(block)
        seq.full_block_keys.append(key)

    def _register(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        self.key_to_block[key] = block
        self.block_keys[block] = key
        self.block_tokens[block] = tokens

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold num_tokens; False (and no change) when the pool is too small."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if missing > len(self.free_blocks):
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(missing))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.full_block_keys), seq.num_computed_tokens // self.block_size):
            parent_key = seq.full_block_keys[-1] if seq.full_block_keys else self._root_key(seq)
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            key = block_key(parent_key, tokens)
            block = seq.block_table[i]
            if key not in self.key_to_block:
                self._register(key, tokens, block)
                if self.storage is not None:
                    self.storage.offer(key, tokens, block)
            seq.full_block_keys.append(key)

    def share_full_blocks(self, parent: Sequence, child: Sequence) -> None:
        """Give a forked sequence its parent's computed full blocks (one more reference each); it computes the rest
        (its partial last block) itself."""
        assert not child.block_table
        shared = parent.num_computed_tokens // self.block_size
        for block in parent.block_table[:shared]:
            self.ref_counts[block] += 1
        child.block_table = parent.block_table[:shared]
        child.full_block_keys = parent.full_block_keys[:shared]
        child.num_computed_tokens = shared * self.block_size

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if self.block_keys[block] is None:  # nothing worth keeping: reuse it first
                    self.free_blocks.move_to_end(block, last=False)
        seq.block_table = []
        seq.full_block_keys = []
        seq.num_computed_tokens = 0
        seq.prefix_matched = False

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
