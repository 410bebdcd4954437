"""The LoRA adapters /v1/models lists: those in the adapters directory (shared with the engine, read here),
each marked loaded when the engine's `tritonllm:lora_adapter_loaded` gauge says it holds a slot."""

import asyncio
import logging
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

LOADED_METRIC = "tritonllm:lora_adapter_loaded"
_METRICS_TIMEOUT_S = 2.0


def available_adapters(lora_dir: str) -> list[str]:
    """Adapter names: the subdirectories holding a PEFT adapter_config.json, relative to lora_dir."""
    root = Path(lora_dir)
    return sorted(path.parent.relative_to(root).as_posix() for path in root.rglob("adapter_config.json")
                  if path.parent != root)


async def loaded_adapters(metrics_url: str) -> set[str] | None:
    """Names of the adapters the engine holds now; None when the metrics cannot be read."""

    def scrape() -> str:
        with urllib.request.urlopen(metrics_url, timeout=_METRICS_TIMEOUT_S) as response:
            return response.read().decode()

    try:
        text = await asyncio.to_thread(scrape)
    except OSError as error:
        logger.warning("cannot read loaded LoRA adapters from %s: %s", metrics_url, error)
        return None
    return {
        sample.labels["adapter"]
        for family in text_string_to_metric_families(text)
        if family.name == LOADED_METRIC
        for sample in family.samples
        if sample.value == 1.0
    }
