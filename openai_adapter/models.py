"""What /v1/models lists: the served model, then each LoRA adapter of the adapters directory (shared with the
engine, named by the rules of backend/interface/lora_names.py) as `<model>:<adapter>`. The engine's metrics add
what only it knows: its `max_model_len`, and whether an adapter holds a slot now (`loaded`)."""

import asyncio
import logging
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from backend.interface.lora_names import available_adapters
from backend.interface.metric_names import GAUGES, LORA_LOADED
from openai_adapter.protocol import ModelCard
from openai_adapter.settings import AdapterSettings

logger = logging.getLogger(__name__)

_METRICS_TIMEOUT_S = 2.0


async def _engine_samples(metrics_url: str) -> list | None:
    """The engine's metric samples; None when the metrics cannot be read."""

    def scrape() -> str:
        with urllib.request.urlopen(metrics_url, timeout=_METRICS_TIMEOUT_S) as response:
            return response.read().decode()

    try:
        text = await asyncio.to_thread(scrape)
    except OSError as error:
        logger.warning("cannot read the engine's metrics from %s: %s", metrics_url, error)
        return None
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


async def model_cards(settings: AdapterSettings, created: int) -> list[ModelCard]:
    samples = await _engine_samples(settings.triton_metrics_url) if settings.triton_metrics_url else None
    max_model_len = next((int(sample.value) for sample in samples or () if sample.name == GAUGES["max_model_len"][0]),
                         None)
    base = settings.served_model_name
    cards = [ModelCard(id=base, created=created, max_model_len=max_model_len)]
    if settings.lora_dir is not None:
        loaded = None if samples is None else {
            sample.labels["adapter"] for sample in samples if sample.name == LORA_LOADED[0] and sample.value == 1.0}
        cards += [
            ModelCard(id=f"{base}:{name}", created=created, parent=base, max_model_len=max_model_len,
                      loaded=None if loaded is None else name in loaded)
            for name in available_adapters(settings.lora_dir)
        ]
    return cards
