"""The engines' own metrics, read from tritonserver's metrics endpoint: one reading per engine instance (label
`instance`). The adapter relays them on its /metrics under the engines' names (one scrape target for dashboards:
deploy/prometheus), and serves their load at /v1/loads in SGLang's shape, which SMG polls on workers it does not
recognise (load-aware policies, overload protection)."""

import asyncio
import time
import urllib.request
from collections import defaultdict
from collections.abc import Collection

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tritonllm.interface.metric_names import ALL_NAMES, GAUGES

_METRICS_TIMEOUT_S = 2.0

RUNNING, WAITING, KV_CACHE_USAGE, PREFIX_CACHE_HIT_RATE, ENGINE_DEAD = (
    GAUGES[key][0] for key in ("running", "waiting", "kv_cache_usage", "prefix_cache_hit_rate", "is_dead"))
LOAD = (RUNNING, WAITING, KV_CACHE_USAGE)
"""The load gauges, per engine instance, that /v1/loads reports."""


async def read_engine_metrics(metrics_url: str) -> list[Metric]:
    """Every metric family tritonserver exports; OSError when it cannot be reached."""

    def scrape() -> str:
        with urllib.request.urlopen(metrics_url, timeout=_METRICS_TIMEOUT_S) as response:
            return response.read().decode()

    return list(text_string_to_metric_families(await asyncio.to_thread(scrape)))


def relayed(families: list[Metric], dead: Collection[str] = ()) -> list[Metric]:
    """The engine's own families (not tritonserver's nv_* ones). The parser names a counter family without its
    `_total`. The `dead` instances' process is gone, so Triton still shows what they last published: their
    engine_dead gauge says 1 instead."""
    kept = [family for family in families
            if family.name in ALL_NAMES or (family.type == "counter" and f"{family.name}_total" in ALL_NAMES)]
    for family in kept:
        if family.name == ENGINE_DEAD:
            family.samples = [sample._replace(value=1.0) if sample.labels.get("instance") in dead else sample
                              for sample in family.samples]
    return kept


def dead_instances(families: list[Metric]) -> list[str]:
    """The engine instances that gave up after failing step after step (they refuse every request)."""
    return sorted(sample.labels.get("instance", "") for family in families if family.name == ENGINE_DEAD
                  for sample in family.samples if sample.value)


def sglang_loads(families: list[Metric]) -> dict:
    """SGLang's /v1/loads answer: one entry ("DP rank") per engine instance, in instance-name order."""
    gauges: dict[str, dict[str, float]] = defaultdict(dict)  # instance → metric name → value
    for family in families:
        if family.name in (*LOAD, PREFIX_CACHE_HIT_RATE):
            for sample in family.samples:
                gauges[sample.labels.get("instance", "")][family.name] = sample.value
    loads = [
        {"dp_rank": rank, "num_running_reqs": int(values.get(RUNNING, 0)),
         "num_waiting_reqs": int(values.get(WAITING, 0)), "token_usage": values.get(KV_CACHE_USAGE, 0.0),
         "cache_hit_rate": values.get(PREFIX_CACHE_HIT_RATE, 0.0)}
        for rank, (_, values) in enumerate(sorted(gauges.items()))
    ]
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dp_rank_count": len(loads),
            "loads": loads}
