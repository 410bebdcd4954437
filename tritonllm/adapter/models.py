"""What /v1/models lists: the served model, then each LoRA adapter of the adapters directory (shared with the
engine, named by the rules of tritonllm/interface/lora_names.py) as `<model>:<adapter>`, then the adapters loaded at
runtime by their own names (tritonllm/adapter/runtime_lora.py). The engine's metrics add
what only it knows: its `max_model_len`, and whether an adapter holds a slot now (`loaded`). The base model's
`root` is its served name (SGLang's, and vLLM's when the model is served under its own name: a client may pass it
back as `model`); an adapter's is its directory (vLLM's)."""

import logging
from pathlib import Path

from tritonllm.interface.lora_names import available_adapters
from tritonllm.interface.metric_names import GAUGES, LORA_LOADED
from tritonllm.adapter.engine_metrics import read_engine_metrics
from tritonllm.adapter.protocol import ModelCard
from tritonllm.adapter.runtime_lora import RuntimeAdapters
from tritonllm.adapter.settings import AdapterSettings

logger = logging.getLogger(__name__)


async def _engine_samples(metrics_url: str | None) -> list | None:
    """The engines' metric samples; None when there are none to read."""
    if metrics_url is None:
        return None
    try:
        return [sample for family in await read_engine_metrics(metrics_url) for sample in family.samples]
    except OSError as error:
        logger.warning("cannot read the engines' metrics from %s: %s", metrics_url, error)
        return None


async def model_cards(settings: AdapterSettings, created: int,
                      runtime_adapters: RuntimeAdapters) -> list[ModelCard]:
    samples = await _engine_samples(settings.triton_metrics_url)
    # with several engine instances, the smallest context is the one every request fits
    max_model_len = min((int(sample.value) for sample in samples or () if sample.name == GAUGES["max_model_len"][0]),
                        default=None)
    base = settings.served_model_name
    cards = [ModelCard(id=base, created=created, root=base, max_model_len=max_model_len)]
    if settings.lora_dir is not None:
        loaded = None if samples is None else {  # held by any engine instance
            sample.labels["adapter"] for sample in samples if sample.name == LORA_LOADED[0] and sample.value == 1.0}
        cards += [
            ModelCard(id=f"{base}:{name}", created=created, root=str(Path(settings.lora_dir) / name), parent=base,
                      max_model_len=max_model_len,
                      loaded=None if loaded is None else name in loaded)
            for name in available_adapters(settings.lora_dir)
        ]
        cards += [  # as vLLM lists them: by their own name
            ModelCard(id=name, created=created, root=str(Path(settings.lora_dir) / path), parent=base,
                      max_model_len=max_model_len, loaded=None if loaded is None else path in loaded)
            for name, path in runtime_adapters.items()
        ]
    return cards
