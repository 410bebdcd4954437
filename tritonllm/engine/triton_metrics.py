"""Engine statistics and per-request measurements published as Triton custom metrics (scraped from tritonserver's
metrics port, and relayed by the adapter's /metrics).

Takes the `triton_python_backend_utils` module as an argument, so this file imports nothing from Triton."""

from __future__ import annotations

import time
from collections import Counter

from tritonllm.interface.errors import Cancelled
from tritonllm.interface.metric_names import COUNTERS, FINISH_REASONS, FINISHED, GAUGES, HISTOGRAMS, LORA_LOADED
from tritonllm.engine.processing.outputs import RequestOutput


class EngineMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        self.families = []  # a family must outlive its metrics, so it is kept here

        def family(name, description, kind):
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return self.families[-1]

        self.gauges = {key: family(n, d, pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
                       for key, (n, d) in GAUGES.items()}
        self.counters = {key: family(n, d, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
                         for key, (n, d) in COUNTERS.items()}
        self.counted = {key: 0 for key in COUNTERS}
        self.labels = labels
        self.lora_family = family(*LORA_LOADED, pb_utils.MetricFamily.GAUGE)
        self.lora_loaded = {}  # adapter name → its gauge, created when the adapter is first loaded
        self.histograms = {key: family(name, description, pb_utils.MetricFamily.HISTOGRAM).Metric(
            labels=labels, buckets=buckets) for key, (name, description, buckets) in HISTOGRAMS.items()}
        self.pending: dict[str, list[float]] = {key: [] for key in HISTOGRAMS}
        finished = family(*FINISHED, pb_utils.MetricFamily.COUNTER)  # every reason exported from the start (at 0)
        self.finished = {reason: finished.Metric(labels={**labels, "finished_reason": reason})
                         for reason in FINISH_REASONS}
        self.pending_finished: Counter[str] = Counter()

    def record(self, histogram: str, value: float) -> None:
        """Note an observation; `update` publishes it (each observation is a round trip to tritonserver, which
        does not belong on a token's path)."""
        self.pending[histogram].append(value)

    def count_finished(self, reason: str) -> None:
        """Note a finished choice (published by `update`, likewise)."""
        self.pending_finished[reason] += 1

    def update(self, stats) -> None:
        """Publish an EngineStats snapshot and the observations recorded since the last update."""
        for key, values in self.pending.items():
            for value in values:
                self.histograms[key].observe(value)
            values.clear()
        for reason, count in self.pending_finished.items():
            self.finished[reason].increment(float(count))
        self.pending_finished.clear()
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


class RequestTracker:
    """One request's measurements, on the responder's thread: token latencies as its outputs go out, and once it
    ends its end-to-end, queue, prefill and decode times (the core's queued and first-scheduled times come with its
    outputs), token counts and each choice's finish reason."""

    def __init__(self, arrived: float, num_prompt_tokens: int, num_choices: int):
        self.arrived = arrived  # time.monotonic() when Triton handed the request to execute()
        self.num_prompt_tokens = num_prompt_tokens
        self.num_choices = num_choices
        self.first_output: float | None = None
        self.last_output: float | None = None
        self.times = None  # the core's RequestTimes, once an output brought them
        self.output_tokens: dict[int, int] = {}  # choice index → tokens generated
        self.finish_reasons: dict[int, str] = {}

    def on_output(self, output: RequestOutput, metrics: EngineMetrics) -> None:
        if output.times is not None:
            self.times = output.times
        for choice in output.choices:
            self.output_tokens[choice.index] = choice.num_output_tokens
            if choice.finish_reason is not None:
                self.finish_reasons[choice.index] = choice.finish_reason
        if not output.choices:
            return
        now = time.monotonic()
        if self.last_output is None:
            metrics.record("time_to_first_token", now - self.arrived)
            self.first_output = now
        else:
            metrics.record("inter_token", now - self.last_output)
        self.last_output = now

    def on_finished(self, metrics: EngineMetrics) -> None:
        """It ended with its last output (every choice has its finish reason)."""
        self._record(metrics, unfinished_reason="abort")

    def on_failed(self, metrics: EngineMetrics, error: Exception) -> None:
        """It ended with an error: cancelled (its unfinished choices count as aborted) or failed in the engine. A
        request refused before the core took it (overloaded, a dead engine) never ran: it is not counted."""
        if isinstance(error, Cancelled):
            self._record(metrics, unfinished_reason="abort")
        elif self.times is not None:
            self._record(metrics, unfinished_reason="error")

    def _record(self, metrics: EngineMetrics, unfinished_reason: str) -> None:
        for index in range(self.num_choices):
            metrics.count_finished(self.finish_reasons.get(index, unfinished_reason))
        metrics.record("e2e", time.monotonic() - self.arrived)
        metrics.record("prompt_tokens", self.num_prompt_tokens)
        metrics.record("generation_tokens", sum(self.output_tokens.values()))
        scheduled = None if self.times is None else self.times.scheduled
        if scheduled is None:
            return
        metrics.record("queue", scheduled - self.times.queued)
        if self.first_output is not None:
            metrics.record("prefill", self.first_output - scheduled)
            metrics.record("decode", self.last_output - self.first_output)
