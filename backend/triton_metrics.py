"""Engine statistics published as Triton custom metrics (scraped from tritonserver's metrics port).

Takes the `triton_python_backend_utils` module as an argument, so this file imports nothing from Triton."""

from __future__ import annotations

import time

from backend.interface.metric_names import COUNTERS, GAUGES, HISTOGRAMS, LORA_LOADED

class EngineMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        self.families = []  # a family must outlive its metrics, so it is kept here

        def family(name, description, kind):
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return self.families[-1].Metric(labels=labels)

        self.gauges = {key: family(n, d, pb_utils.MetricFamily.GAUGE) for key, (n, d) in GAUGES.items()}
        self.counters = {key: family(n, d, pb_utils.MetricFamily.COUNTER) for key, (n, d) in COUNTERS.items()}
        self.counted = {key: 0 for key in COUNTERS}
        self.labels = labels
        self.lora_family = pb_utils.MetricFamily(name=LORA_LOADED[0], description=LORA_LOADED[1],
                                                 kind=pb_utils.MetricFamily.GAUGE)
        self.lora_loaded = {}  # adapter name → its gauge, created when the adapter is first loaded
        self.histograms = {}
        for key, (name, description, buckets) in HISTOGRAMS.items():
            self.families.append(pb_utils.MetricFamily(name=name, description=description,
                                                       kind=pb_utils.MetricFamily.HISTOGRAM))
            self.histograms[key] = self.families[-1].Metric(labels=labels, buckets=buckets)
        self.pending: dict[str, list[float]] = {key: [] for key in HISTOGRAMS}

    def record(self, histogram: str, seconds: float) -> None:
        """Note an observation; `update` publishes it (each observation is a round trip to tritonserver, which
        does not belong on a token's path)."""
        self.pending[histogram].append(seconds)

    def update(self, stats) -> None:
        """Publish an EngineStats snapshot and the observations recorded since the last update."""
        for key, values in self.pending.items():
            for value in values:
                self.histograms[key].observe(value)
            values.clear()
        for key, metric in self.gauges.items():
            metric.set(float(getattr(stats, key)))
        for key, metric in self.counters.items():
            metric.increment(float(getattr(stats, key) - self.counted[key]))
            self.counted[key] = getattr(stats, key)
        loaded = set(stats.loaded_loras)
        for name in loaded - set(self.lora_loaded):
            self.lora_loaded[name] = self.lora_family.Metric(labels={**self.labels, "adapter": name})
        for name, metric in self.lora_loaded.items():
            metric.set(1.0 if name in loaded else 0.0)


class LatencyTracker:
    """One request's token timing: arrival → first output, then the gaps between outputs."""

    def __init__(self):
        self.arrived = time.monotonic()
        self.last_output: float | None = None

    def on_output(self, metrics: EngineMetrics) -> None:
        now = time.monotonic()
        if self.last_output is None:
            metrics.record("time_to_first_token", now - self.arrived)
        else:
            metrics.record("inter_token", now - self.last_output)
        self.last_output = now
