"""Engine statistics published as Triton custom metrics (scraped from tritonserver's metrics port).

Takes the `triton_python_backend_utils` module as an argument, so this file imports nothing from Triton."""

from __future__ import annotations

import time

GAUGES = {
    "running": ("tritonllm:num_requests_running", "Sequences in the running batch"),
    "waiting": ("tritonllm:num_requests_waiting", "Sequences waiting for admission"),
    "free_blocks": ("tritonllm:kv_cache_free_blocks", "Free blocks of the paged KV cache"),
    "total_blocks": ("tritonllm:kv_cache_total_blocks", "Blocks of the paged KV cache"),
    "prefix_cache_hit_rate": ("tritonllm:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache"),
}
COUNTERS = {
    "prompt_tokens": ("tritonllm:prompt_tokens_total", "Prompt tokens of admitted requests"),
    "generated_tokens": ("tritonllm:generation_tokens_total", "Generated tokens"),
    "preemptions": ("tritonllm:preemptions_total", "Sequences preempted to free KV blocks"),
}


LORA_LOADED = ("tritonllm:lora_adapter_loaded",
               "1 while the LoRA adapter (label adapter) holds a slot of the pool, 0 once evicted")

HISTOGRAMS = {
    "time_to_first_token": ("tritonllm:time_to_first_token_seconds", "Time from arrival to the first token",
                            [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
    "inter_token": ("tritonllm:inter_token_latency_seconds", "Time between a request's consecutive outputs",
                    [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
}


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

    def update(self, stats) -> None:
        """Publish an EngineStats snapshot."""
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
            metrics.histograms["time_to_first_token"].observe(now - self.arrived)
        else:
            metrics.histograms["inter_token"].observe(now - self.last_output)
        self.last_output = now
