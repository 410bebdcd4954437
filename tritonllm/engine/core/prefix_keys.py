"""The prefix cache's keys: stable content hashes, the same in every process, stack and restart, so a key can
name a block in host memory or in a file another stack wrote.

A block's key hashes its parent's key and its own token ids; the first block's parent is the sequence's root, a
hash of the model's identity (its files' content, the weight format it runs in, the KV cache's dtype and block
size, the architecture), the LoRA adapter (name and files) and the request's `cache_salt`. Equal keys therefore
mean the same K/V values, and anything that would change them changes the key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

KEY_BYTES = 16  # blake2b-128: collisions are out of reach for any cache size
_SAMPLE_BYTES = 1 << 20  # of a large file, its first and last MiB are hashed (with its size): identity, not integrity


def _hash(*parts: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def files_digest(directory: Path) -> bytes:
    """A content digest of a model (or adapter) directory, computed once: every file's relative path and size,
    small files whole and large ones (weights) by their first and last MiB, which hold a safetensors or GGUF
    header and data. Independent of paths and modification times, so copies of one model agree."""
    parts = []
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        size = path.stat().st_size
        with path.open("rb") as file:
            if size <= 2 * _SAMPLE_BYTES:
                sample = file.read()
            else:
                head = file.read(_SAMPLE_BYTES)
                file.seek(size - _SAMPLE_BYTES)
                sample = head + file.read()
        parts += [str(path.relative_to(directory)).encode(), size.to_bytes(8, "little"), sample]
    return _hash(*parts)


def model_key(files: bytes, **facts: object) -> bytes:
    """The model's identity: its files' digest and what else decides its K/V (weight format, KV dtype, block size,
    architecture, device type), each given by name."""
    return _hash(b"model", files, *(f"{name}={facts[name]!r}".encode() for name in sorted(facts)))


def root_key(model: bytes, adapter: tuple[str, bytes] | None, cache_salt: str | None) -> bytes:
    """The parent key of a sequence's first block."""
    name, files = adapter or ("", b"")
    return _hash(b"root", model, name.encode(), files, b"" if cache_salt is None else b"salt=" + cache_salt.encode())


def block_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    return _hash(parent, np.asarray(tokens, dtype="<i8").tobytes())
