"""The LoRA adapters /v1/models lists: those in the adapters directory (shared with the engine, named by the
rules of backend/interface/lora_names.py), each marked loaded when the engine's `tritonllm:lora_adapter_loaded`
gauge says it holds a slot (in any engine instance)."""

import logging

from backend.interface.lora_names import available_adapters
from backend.interface.metric_names import LORA_LOADED
from openai_adapter.engine_metrics import read_engine_metrics

logger = logging.getLogger(__name__)


async def loaded_adapters(metrics_url: str) -> set[str] | None:
    """Names of the adapters the engines hold now; None when the metrics cannot be read."""
    try:
        families = await read_engine_metrics(metrics_url)
    except OSError as error:
        logger.warning("cannot read loaded LoRA adapters from %s: %s", metrics_url, error)
        return None
    return {
        sample.labels["adapter"]
        for family in families
        if family.name == LORA_LOADED[0]
        for sample in family.samples
        if sample.value == 1.0
    }
