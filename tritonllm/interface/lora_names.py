"""LoRA adapter names: an adapter is a subdirectory of the adapters directory holding PEFT's adapter_config.json,
named by its path relative to the directory. Both the engine (which loads adapters) and the adapter (which lists
them in /v1/models) go by these rules."""

from __future__ import annotations

from pathlib import Path

from tritonllm.interface.errors import InvalidRequest, NotFound

CONFIG_FILE = "adapter_config.json"


def available_adapters(root: str | Path) -> list[str]:
    root = Path(root).resolve()
    return sorted(path.parent.relative_to(root).as_posix() for path in root.rglob(CONFIG_FILE)
                  if path.parent != root)


def resolve_adapter(root: str | Path, lora_path: str) -> str:
    """An adapter name or a path inside the directory → the adapter's name. Symlinks and `..` are followed
    first, so nothing outside the directory is reachable."""
    root = Path(root).resolve()
    try:
        candidate = (root / lora_path).resolve()
        inside = root in candidate.parents
        exists = inside and (candidate / CONFIG_FILE).is_file()
    except (OSError, ValueError):  # NUL bytes, or characters the file system encoding lacks: no such file
        inside, exists = True, False
    if not inside:
        raise InvalidRequest(f"lora_path {lora_path!r} is not inside the adapters directory", "lora_path")
    if not exists:
        raise NotFound(f"there is no LoRA adapter {lora_path!r} (available: {', '.join(available_adapters(root))})",
                       "lora_path")
    return candidate.relative_to(root).as_posix()
