"""LoRA adapters loaded at runtime: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter give a name of
the client's choosing to an adapter inside the adapters directory.

This process owns the names alone (one event loop, no file, no message to the engines): a request naming a
runtime adapter leaves for Triton with the adapter's path inside lora_dir in `lora_path`, which every engine
instance already serves by the rules of tritonllm/interface/lora_names.py. So a load or unload is seen at once by
every instance and by /v1/models, and unloading touches nothing already sent: running requests finish with
their adapter (its engine slot stays pinned while they use it), later ones naming it get 404."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from tritonllm.interface.errors import RequestError
from tritonllm.interface.lora_names import available_adapters, resolve_adapter
from tritonllm.adapter.errors import AdapterError, from_kind, invalid_request, not_found

VLLM_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_allowed(setting: bool) -> bool:
    """The setting, or vLLM's environment variable for it (read as vLLM does: 1 or true)."""
    return setting or os.environ.get(VLLM_ENV, "0").strip().lower() in ("1", "true")


class RuntimeAdapters:
    """Runtime adapter names → the adapter's path inside lora_dir (its name to the engines)."""

    def __init__(self, lora_dir: str | None, served_model_name: str, allowed: bool) -> None:
        self._lora_dir = lora_dir
        self._served_model_name = served_model_name
        self._allowed = allowed
        self._paths: dict[str, str] = {}

    def path_of(self, name: str) -> str | None:
        return self._paths.get(name)

    def items(self) -> list[tuple[str, str]]:
        """(name, path inside lora_dir), in the order they were loaded."""
        return list(self._paths.items())

    async def load(self, name: str, lora_path: str, check: Callable[[str], Awaitable[object]]) -> str:
        """Register `name` for the adapter at `lora_path` once `check` (an engine reading its files) accepts it."""
        lora_dir = self._enabled()
        self._check_free(name, lora_dir)
        try:
            path = resolve_adapter(lora_dir, lora_path)
        except RequestError as error:  # outside the directory (400) or no adapter there (404)
            raise from_kind(error.kind, error.message, error.param) from None
        await check(path)
        self._check_free(name, lora_dir)  # another load of the name may have finished meanwhile
        self._paths[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        self._enabled()
        if self._paths.pop(name, None) is None:
            raise not_found(f"The lora adapter '{name}' cannot be found.", "lora_name")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _enabled(self) -> str:
        if not self._allowed:  # vLLM has no such routes then: 404
            raise AdapterError(404, "Loading LoRA adapters at runtime is disabled on this server (enable it with "
                               f"--allow-runtime-lora or {VLLM_ENV}=true).", error_type="invalid_request_error")
        if self._lora_dir is None:
            raise invalid_request("LoRA adapters are not enabled on this server (no --lora-dir): runtime adapters "
                                  "are loaded from inside that directory.", "lora_path")
        return self._lora_dir

    def _check_free(self, name: str, lora_dir: str) -> None:
        """A name already given (to a runtime adapter, a directory adapter or the base model) is refused."""
        if name in self._paths or name == self._served_model_name or name in available_adapters(Path(lora_dir)):
            raise invalid_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
