"""The LoRA adapters /v1/models lists: those in the adapters directory (shared with the engine, named by the
rules of backend/interface/lora_names.py), each marked loaded when the engine's `tritonllm:lora_adapter_loaded`
gauge says it holds a slot."""

import asyncio
import logging
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from backend.interface.lora_names import available_adapters
from backend.interface.metric_names import LORA_LOADED

logger = logging.getLogger(__name__)

_METRICS_TIMEOUT_S = 2.0


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
        if family.name == LORA_LOADED[0]
        for sample in family.samples
        if sample.value == 1.0
    }
