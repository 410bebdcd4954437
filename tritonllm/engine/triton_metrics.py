"""Engine statistics and per-request measurements published as Triton custom metrics (scraped from tritonserver's
metrics port, and relayed by the adapter's /metrics).

Takes the `triton_python_backend_utils` module as an argument, so this file imports nothing from Triton."""

from __future__ import annotations

import logging
import time
from collections import Counter

from tritonllm.interface.errors import Cancelled
from tritonllm.interface.metric_names import (COUNTERS, FINISH_REASONS, FINISHED, GAUGES, HISTOGRAMS, INTERNAL_ERRORS,
                                              LORA_LOADED, PREFIX_CACHE_HITS)
from tritonllm.interface.tensors import CACHE_TIERS, FinishReason
from tritonllm.engine.processing.outputs import RequestOutput

log = logging.getLogger(__name__)


class InternalErrors:
    """Failures of background work that the engine survives (a responder job, one metric observation): each is
    counted in tritonllm:internal_errors_total by where it happened, the first of each place is logged with its
    traceback, and the later ones in one line with their count at most every LOG_INTERVAL_S, so a failure that
    repeats on every turn of a loop is seen (in the log and the counter) without flooding the log."""

    LOG_INTERVAL_S = 60.0

    def __init__(self, family, labels: dict[str, str]):
        self._family = family
        self._labels = labels
        self._counters = {}  # where → its counter
        self._unlogged: Counter[str] = Counter()  # where → failures since the last log line
        self._logged_at: dict[str, float] = {}

    def report(self, where: str, error: BaseException) -> None:
        counter = self._counters.get(where)
        if counter is None:
            counter = self._counters[where] = self._family.Metric(labels={**self._labels, "where": where})
        counter.increment(1.0)
        now = time.monotonic()
        last = self._logged_at.get(where)
        if last is None:
            self._logged_at[where] = now
            log.error("internal error in %s (counted in %s; repeats are logged once a minute with their count)",
                      where, INTERNAL_ERRORS[0], exc_info=error)
            return
        self._unlogged[where] += 1
        if now - last >= self.LOG_INTERVAL_S:
            log.error("internal error in %s repeated %d times in the last %.0f s, the latest: %r", where,
                      self._unlogged.pop(where), now - last, error)
            self._logged_at[where] = now


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
        hits = family(*PREFIX_CACHE_HITS, pb_utils.MetricFamily.COUNTER)
        self.prefix_cache_hits = [hits.Metric(labels={**labels, "tier": tier}) for tier in CACHE_TIERS]
        self.counted_hits = [0] * len(CACHE_TIERS)
        self.labels = labels
        self.lora_family = family(*LORA_LOADED, pb_utils.MetricFamily.GAUGE)
        self.lora_loaded = {}  # adapter name → its gauge, created when the adapter is first loaded
        self.histograms = {key: family(name, description, pb_utils.MetricFamily.HISTOGRAM).Metric(
            labels=labels, buckets=buckets) for key, (name, description, buckets) in HISTOGRAMS.items()}
        self.pending: dict[str, list[float]] = {key: [] for key in HISTOGRAMS}
        finished = family(*FINISHED, pb_utils.MetricFamily.COUNTER)  # every reason exported from the start (at 0)
        self.finished = {reason: finished.Metric(labels={**labels, "finished_reason": str(reason)})
                         for reason in FINISH_REASONS}
        self.pending_finished: Counter[str] = Counter()
        self.internal_errors = InternalErrors(family(*INTERNAL_ERRORS, pb_utils.MetricFamily.COUNTER), labels)

    def record(self, histogram: str, value: float) -> None:
        """Note an observation; `update` publishes it (each observation is a round trip to tritonserver, which
        does not belong on a token's path)."""
        self.pending[histogram].append(value)

    def count_finished(self, reason: str) -> None:
        """Note a finished choice (published by `update`, likewise)."""
        self.pending_finished[reason] += 1

    def update(self, stats) -> None:
        """Publish an EngineStats snapshot and the observations recorded since the last update. Each is published
        on its own: one that fails is reported (InternalErrors) and dropped, and never holds up the others."""
        pending, self.pending = self.pending, {key: [] for key in HISTOGRAMS}
        finished, self.pending_finished = self.pending_finished, Counter()
        for key, values in pending.items():
            for value in values:
                self._publish(lambda: self.histograms[key].observe(value))
        for reason, count in finished.items():
            self._publish(lambda: self.finished[reason].increment(float(count)))
        for key, metric in self.gauges.items():
            self._publish(lambda: metric.set(float(getattr(stats, key))))
        for key, metric in self.counters.items():
            value = getattr(stats, key)
            self._publish(lambda: metric.increment(float(value - self.counted[key])))
            self.counted[key] = value
        for metric, count, counted in zip(self.prefix_cache_hits, stats.prefix_cache_hits, self.counted_hits):
            self._publish(lambda: metric.increment(float(count - counted)))
        self.counted_hits = list(stats.prefix_cache_hits)
        self._publish(lambda: self._update_lora_loaded(set(stats.loaded_loras)))

    def _update_lora_loaded(self, loaded: set[str]) -> None:
        for name in loaded - set(self.lora_loaded):
            self.lora_loaded[name] = self.lora_family.Metric(labels={**self.labels, "adapter": name})
        for name, metric in self.lora_loaded.items():
            metric.set(1.0 if name in loaded else 0.0)

    def _publish(self, publish) -> None:
        try:
            publish()
        except Exception as error:  # one bad observation (say an unknown label) must not freeze every metric
            self.internal_errors.report("metrics", error)


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
        self._record(metrics, unfinished_reason=FinishReason.ABORT)

    def on_failed(self, metrics: EngineMetrics, error: Exception) -> None:
        """It ended with an error: cancelled (its unfinished choices count as aborted) or failed in the engine. A
        request refused before the core took it (overloaded, a dead engine) never ran: it is not counted."""
        if isinstance(error, Cancelled):
            self._record(metrics, unfinished_reason=FinishReason.ABORT)
        elif self.times is not None:
            self._record(metrics, unfinished_reason=FinishReason.ERROR)

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
