"""The KV cache's lower tiers, below the device pool (block_manager.py): a byte-bounded pool of host memory that
keeps the full blocks the device pool evicts, and a directory of block files that every computed block is written
to, shared by the stacks that mount it and kept across restarts; each drops its least recently used blocks.

A prefix match runs device → host → storage: the block manager takes a device block for each host hit and copies
the block's K/V into it while it schedules, so the step that needs them finds them in place. Storage is slower: a
match that reaches it starts a read (`StorageRead`) and the sequence waits for it, off the batch, while the others
step; the core picks up the blocks read at the top of a later step and copies them into device blocks. Copies are
exact (the same dtype, the same bytes), so a hit gives the output a cold run gives. The host tier lives on the
core's thread; the storage tier's files are written and read by threads of its own."""

from __future__ import annotations

import logging
import math
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tritonllm.engine.config import AUTO

log = logging.getLogger(__name__)


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

    def read(self, block: int) -> torch.Tensor:
        """A copy of a block in host memory (synchronous)."""
        return torch.stack([cache[block] for cache in self.caches]).cpu()

    def write(self, block: int, kv: torch.Tensor) -> None:
        kv = kv.to(self.device, non_blocking=True)
        for cache, part in zip(self.caches, kv):
            cache[block].copy_(part)


class HostTier:
    """Blocks in a preallocated slab of host memory (pinned on CUDA), least recently used first out. Exclusive of
    the device pool: a block copied back leaves it, and comes back when the device pool evicts it again."""

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

    def take(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The K/V of `key` copied to the device (None when this tier does not hold it), leaving this tier: its
        slot is free for the device block about to be reused for it (the copy is ordered before any write)."""
        slot = self.slots.get(key)
        if slot is None or self.tokens[slot] != tokens:
            return None
        del self.slots[key]
        self.free_slots.append(slot)
        return self.slab[slot].to(self.blocks.device, copy=True, non_blocking=True)


WRITE_QUEUE_BLOCKS = 64  # blocks waiting for the storage writer; when full, a block is not written (never waited for)
# the longest a sequence waits for the next block of a storage read (no other sequence waits for it): a block that
# has not come by then, and those after it, are a miss (a run of blocks that keep coming is read whole: far faster
# than computing it)
BLOCK_READ_WAIT_SECONDS = 0.1
RESCAN_SECONDS = 60.0  # how often the writer re-reads the directory, to see the files other stacks wrote
_HEADER = struct.Struct("<8s16s16sIQI")  # magic, model key, block key, token count, payload bytes, payload crc32
_MAGIC = b"TLLMKV01"


def block_path(directory: Path, key: bytes) -> Path:
    name = key.hex()
    return directory / name[:2] / f"{name}.kv"


def encode_block(model: bytes, key: bytes, tokens: tuple[int, ...], kv: torch.Tensor) -> bytes:
    """A block's file: a header naming the model and the key, the tokens, the K/V bytes, and their checksum."""
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    token_bytes = np.asarray(tokens, dtype="<i8").tobytes()
    return (_HEADER.pack(_MAGIC, model, key, len(tokens), len(payload), zlib.crc32(payload))
            + token_bytes + payload)


def decode_block(data: bytes, model: bytes, key: bytes, tokens: tuple[int, ...], blocks: DeviceBlocks
                 ) -> torch.Tensor | None:
    """The K/V of a block file, or None when it is not this model's block of these tokens, or damaged."""
    if len(data) < _HEADER.size:
        return None
    magic, file_model, file_key, num_tokens, size, crc = _HEADER.unpack_from(data)
    start = _HEADER.size + 8 * num_tokens
    if (magic, file_model, file_key, num_tokens, size) != (_MAGIC, model, key, len(tokens), blocks.bytes_per_block) \
            or len(data) != start + size:
        return None
    if tuple(np.frombuffer(data, dtype="<i8", count=num_tokens, offset=_HEADER.size).tolist()) != tokens:
        return None
    payload = memoryview(data)[start:]
    if zlib.crc32(payload) != crc:
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(blocks.dtype).view(blocks.shape)


@dataclass(frozen=True)
class _Write:
    key: bytes
    tokens: tuple[int, ...]
    kv: torch.Tensor  # a copy on the host


@dataclass(frozen=True)
class _Touch:  # a block was read: it becomes the most recently used
    key: bytes


@dataclass(frozen=True)
class BlockRead:
    """The reader's message to the core: the next block of a run (its K/V on the host), or None at the first miss."""

    kv: torch.Tensor | None
    at: float  # when it was read (time.monotonic)


class StorageRead:
    """A run of blocks read from storage for one sequence. The reader thread sends a BlockRead per block through
    `arrivals` and stops at the first miss or once `cancelled`; everything else is the core thread's."""

    def __init__(self, chain: list[tuple[bytes, tuple[int, ...]]]):
        self.chain = chain
        self.arrivals: queue.SimpleQueue[BlockRead] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.found: list[torch.Tensor] = []  # the K/V read so far, in order
        self.deadline = time.monotonic() + BLOCK_READ_WAIT_SECONDS  # for the next block
        self.missed = False

    def done(self, now: float) -> bool:
        """Whether the run is over: every block read, a miss, or the next block late (the rest is then a miss)."""
        while not self.missed and len(self.found) < len(self.chain):
            try:
                block = self.arrivals.get_nowait()
            except queue.Empty:
                return now >= self.deadline
            if block.kv is None:
                self.missed = True
            else:
                self.found.append(block.kv)
                self.deadline = block.at + BLOCK_READ_WAIT_SECONDS
        return True

    def cancel(self) -> None:
        """Stop reading (the sequence no longer waits: its run is over, or it was aborted)."""
        self.cancelled.set()


class StorageTier:
    """Blocks as files under a directory (one a block, named by its key), bounded in bytes, least recently used
    out. Every computed block is offered to it (write-through), so a prefix survives the device and host pools, a
    restart, and serves the other stacks sharing the directory.

    The core never waits for a write: a writer thread owns the files and their index, fed by a bounded queue
    (a full queue drops the block). Nor for a read: a reader thread reads a run of blocks (`start_read`) and hands
    them over one by one, and the sequence that asked waits for each at most BLOCK_READ_WAIT_SECONDS; a slow,
    missing, truncated, corrupted or foreign file ends the run (a miss). The reader calls `on_read_done` when it
    leaves a run (the core loop's wake-up call).
    Files are written under a temporary name and renamed, so a reader never sees half a file."""

    def __init__(self, directory: str | Path, capacity: int, model: bytes, blocks: DeviceBlocks):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.model = model
        self.blocks = blocks
        self.dropped_writes = 0  # blocks not written because the writer was behind
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # keys written or read lately: not offered again
        self._writes: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_BLOCKS)
        self._reads: queue.SimpleQueue[StorageRead | None] = queue.SimpleQueue()
        self.on_read_done: Callable[[], None] = lambda: None  # called on the reader's thread
        self._threads = [threading.Thread(target=self._write_loop, name="kv-storage-writer", daemon=True),
                         threading.Thread(target=self._read_loop, name="kv-storage-reader", daemon=True)]
        for thread in self._threads:
            thread.start()

    # the core's thread

    def offer(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        """Write a newly computed block, unless the writer is behind."""
        if key in self._recent:
            return
        if self._writes.full():
            self.dropped_writes += 1
            return
        self._writes.put_nowait(_Write(key, tokens, self.blocks.read(block)))
        self._remember(key)

    def start_read(self, chain: list[tuple[bytes, tuple[int, ...]]]) -> StorageRead:
        """Start reading the K/V of `chain`'s blocks; the caller polls `done` and then calls `finish_read`."""
        read = StorageRead(chain)
        self._reads.put(read)
        return read

    def finish_read(self, read: StorageRead) -> list[torch.Tensor]:
        """The K/V of the run's blocks read in time (after `read.done`); they become the most recently used."""
        read.cancel()
        for key, _ in read.chain[:len(read.found)]:
            self._remember(key)
            try:
                self._writes.put_nowait(_Touch(key))
            except queue.Full:
                pass
        return read.found

    def wait_for_writes(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) for the queued writes to land; whether they did."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        self._reads.put(None)
        try:
            self._writes.put_nowait(None)
        except queue.Full:  # the writer is behind: it is a daemon thread, its pending writes are dropped
            pass

    def _remember(self, key: bytes) -> None:
        self._recent[key] = None
        self._recent.move_to_end(key)
        if len(self._recent) > 4 * WRITE_QUEUE_BLOCKS + self.capacity // self.blocks.bytes_per_block:
            self._recent.popitem(last=False)

    # the reader's thread

    def _read_loop(self) -> None:
        while (run := self._reads.get()) is not None:
            for key, tokens in run.chain:
                if run.cancelled.is_set():
                    break
                kv = self._read(key, tokens)
                run.arrivals.put(BlockRead(kv, time.monotonic()))
                if kv is None:
                    break
            self.on_read_done()

    def _read(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        try:
            data = read_block_file(block_path(self.directory, key))
        except OSError:
            return None
        kv = decode_block(data, self.model, key, tokens, self.blocks)
        if kv is None:  # removed, so that the block is written again once computed
            log.warning("KV storage: %s is not a block of this model, or damaged: a miss, removed",
                        block_path(self.directory, key))
            block_path(self.directory, key).unlink(missing_ok=True)
        return kv

    # the writer's thread: the only one that changes the directory (of this process)

    def _write_loop(self) -> None:
        files: OrderedDict[Path, int] = OrderedDict()  # path → bytes, least recently used first
        next_scan = 0.0
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                if time.monotonic() >= next_scan:
                    files = self._scan()
                    next_scan = time.monotonic() + RESCAN_SECONDS
                path = block_path(self.directory, item.key)
                if isinstance(item, _Touch) or path.exists():  # (maybe written by another stack since the scan)
                    os.utime(path)  # recently used, for every stack's next scan too
                    files[path] = files.pop(path, 0) or path.stat().st_size
                    continue
                data = encode_block(self.model, item.key, item.tokens, item.kv)
                write_block_file(path, data)
                files[path] = len(data)
                self._evict(files)
            except OSError as error:  # e.g. a full disk, or a file another stack removed: the cache goes on
                log.warning("KV storage: %s", error)
            finally:
                self._writes.task_done()

    def _scan(self) -> OrderedDict[Path, int]:
        """The directory's block files (every stack's), least recently used first."""
        found = []
        for path in self.directory.glob("*/*.kv"):
            try:
                stat = path.stat()
            except OSError:  # removed meanwhile
                continue
            found.append((stat.st_mtime, path, stat.st_size))
        return OrderedDict((path, size) for _, path, size in sorted(found))

    def _evict(self, files: OrderedDict[Path, int]) -> None:
        total = sum(files.values())
        while total > self.capacity and files:
            path, size = files.popitem(last=False)
            total -= size
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def read_block_file(path: Path) -> bytes:
    return path.read_bytes()


def write_block_file(path: Path, data: bytes) -> None:
    """Write under a temporary name, then rename: readers (other stacks too) see the whole file or none."""
    path.parent.mkdir(exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
