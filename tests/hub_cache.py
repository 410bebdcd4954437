"""A Hugging Face hub cache filled by hand, in the hub client's layout, for tests that resolve hub ids offline:
<cache>/models--ORG--NAME/{blobs/<digest>, snapshots/<commit>/<file> → ../../blobs/<digest>, refs/<revision>}."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hub_cache(cache_dir: Path, repo_id: str, files: dict[str, Path], revision: str = "main") -> Path:
    """Cache `files` (name in the repository → local file) as the commit `revision` points to; the snapshot
    directory, as snapshot_download returns it. A large file is linked into blobs/, not copied."""
    repo_dir = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        os.symlink(Path(source).resolve(), blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / revision).write_text(commit)
    return snapshot


def add_model_dir_to_hub_cache(cache_dir: Path, repo_id: str, model_dir: Path, revision: str = "main") -> Path:
    """Cache every file of a model directory (as a hub repository holds a checkpoint) under `repo_id`."""
    return add_to_hub_cache(cache_dir, repo_id, {path.name: path for path in model_dir.iterdir() if path.is_file()},
                            revision)
