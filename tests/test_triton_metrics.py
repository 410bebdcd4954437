"""The engine's Triton custom metrics without Triton: a stand-in for pb_utils' MetricFamily records what the
responder publishes for requests that finish, are cancelled, fail in the engine or are refused before it."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from tritonllm.engine.core.sequence import RequestTimes
from tritonllm.interface.errors import Cancelled, EngineDead, Overloaded
from tritonllm.interface.metric_names import FINISH_REASONS, GAUGES, HISTOGRAMS, INTERNAL_ERRORS
from tritonllm.engine.processing.outputs import ChoiceDelta, RequestOutput
from tritonllm.engine.triton_metrics import EngineMetrics, RequestTracker


class _FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    published: dict = {}  # (family name, label items) → observations, increments or the value set

    def __init__(self, name: str, description: str, kind: str):
        self.name = name

    def Metric(self, labels: dict, buckets=None):
        family, key = self, (self.name, tuple(sorted(labels.items())))
        published = _FakeMetricFamily.published
        published[key] = []

        class Metric:
            def observe(self, value):
                published[key].append(value)

            def increment(self, value):
                published[key].append(value)

            def set(self, value):
                published[key] = [value]
        return Metric()


class _FakePbUtils:
    MetricFamily = _FakeMetricFamily


LABELS = {"model": "llm", "version": "1", "instance": "llm_0_0"}


@pytest.fixture
def metrics() -> EngineMetrics:
    _FakeMetricFamily.published = {}
    return EngineMetrics(_FakePbUtils, LABELS)


def _published(metrics: EngineMetrics, stats) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(histogram key → observations, finish reason → count) after the responder's metrics poll."""
    metrics.update(stats)
    label_key = tuple(sorted(LABELS.items()))
    histograms = {key: _FakeMetricFamily.published[(name, label_key)] for key, (name, _, _) in HISTOGRAMS.items()}
    finished = {reason: sum(_FakeMetricFamily.published[
        ("vllm:request_success_total", tuple(sorted({**LABELS, "finished_reason": reason}.items())))])
        for reason in FINISH_REASONS}
    return histograms, finished


def _none_but(**counts: int) -> dict[str, int]:
    return {**dict.fromkeys(FINISH_REASONS, 0), **counts}


class _Stats:
    running = waiting = free_blocks = total_blocks = prefix_cache_hit_rate = max_model_len = is_dead = 0
    kv_cache_usage = prompt_tokens = generated_tokens = preemptions = 0
    prefix_cache_hits = (0, 0, 0)
    loaded_loras = ()


def _delta(index: int, tokens: int, finish_reason: str | None = None) -> ChoiceDelta:
    return ChoiceDelta(index, "x", [], 0.0, tokens, finish_reason)


def test_a_finished_request_publishes_its_times_tokens_and_each_choices_finish_reason(metrics):
    arrived = time.monotonic()
    times = RequestTimes(queued=arrived + 0.01, scheduled=arrived + 0.03)
    tracker = RequestTracker(arrived, num_prompt_tokens=7, num_choices=2)
    tracker.on_output(RequestOutput("r", [], 7, 0, False, times=RequestTimes(times.queued, None)), metrics)
    time.sleep(0.04)
    tracker.on_output(RequestOutput("r", [_delta(0, 1), _delta(1, 1)], 7, 0, False, times=times), metrics)
    time.sleep(0.02)
    tracker.on_output(RequestOutput("r", [_delta(0, 3, "stop"), _delta(1, 5, "length")], 7, 0, True, times=times),
                      metrics)
    tracker.on_finished(metrics)
    histograms, finished = _published(metrics, _Stats())
    assert finished == _none_but(stop=1, length=1, abort=0, error=0)
    assert histograms["prompt_tokens"] == [7] and histograms["generation_tokens"] == [8]
    [e2e], [queue], [prefill], [decode] = (histograms[key] for key in ("e2e", "queue", "prefill", "decode"))
    assert queue == pytest.approx(0.02)
    assert prefill >= 0.04 - 0.03 and decode >= 0.02 and e2e >= 0.01 + queue + prefill + decode
    assert len(histograms["time_to_first_token"]) == 1 and len(histograms["inter_token"]) == 1
    metrics.update(_Stats())  # published once
    assert _published(metrics, _Stats())[1]["stop"] == 1


def test_a_cancelled_request_counts_its_unfinished_choices_as_aborted(metrics):
    tracker = RequestTracker(time.monotonic(), num_prompt_tokens=3, num_choices=2)
    tracker.on_output(RequestOutput("r", [_delta(0, 2, "stop"), _delta(1, 2)], 3, 0, False,
                                    times=RequestTimes(time.monotonic(), time.monotonic())), metrics)
    tracker.on_failed(metrics, Cancelled("the request was cancelled"))
    histograms, finished = _published(metrics, _Stats())
    assert finished == _none_but(stop=1, length=0, abort=1, error=0)
    assert len(histograms["e2e"]) == len(histograms["queue"]) == len(histograms["decode"]) == 1


def test_a_request_cancelled_while_queued_has_no_queue_time(metrics):
    RequestTracker(time.monotonic(), 3, 1).on_failed(metrics, Cancelled("the request was cancelled"))
    histograms, finished = _published(metrics, _Stats())
    assert finished["abort"] == 1 and len(histograms["e2e"]) == 1 and histograms["queue"] == []


def test_a_request_that_fails_in_the_engine_counts_as_error_one_refused_before_it_not_at_all(metrics):
    failed = RequestTracker(time.monotonic(), 3, 1)
    failed.on_output(RequestOutput("r", [], 3, 0, True, error=EngineDead("dead"),
                                   times=RequestTimes(time.monotonic(), None)), metrics)
    failed.on_failed(metrics, EngineDead("dead"))
    for refusal in (Overloaded("full"), EngineDead("dead")):
        refused = RequestTracker(time.monotonic(), 3, 1)
        refused.on_output(RequestOutput("r", [], 3, 0, True, error=refusal), metrics)
        refused.on_failed(metrics, refusal)
    histograms, finished = _published(metrics, _Stats())
    assert finished == _none_but(stop=0, length=0, abort=0, error=1)
    assert len(histograms["e2e"]) == 1 and histograms["queue"] == []  # never scheduled


def test_every_finish_reason_is_exported_from_the_start(metrics):
    assert _published(metrics, _Stats())[1] == dict.fromkeys(FINISH_REASONS, 0)


def test_a_tool_call_is_counted_under_its_finish_reason(metrics):
    tracker = RequestTracker(time.monotonic(), 3, 1)
    tracker.on_output(RequestOutput("r", [_delta(0, 9, "tool_calls")], 3, 0, True,
                                    times=RequestTimes(time.monotonic(), time.monotonic())), metrics)
    tracker.on_finished(metrics)
    assert _published(metrics, _Stats())[1] == _none_but(tool_calls=1)


def test_an_observation_that_fails_is_counted_and_blocks_nothing(metrics, caplog):
    """A finish reason no counter knows (the KeyError that froze every metric) fails alone, on every poll, and the
    failures are counted in internal_errors_total and logged once with their count."""
    stats = _Stats()
    label_key = tuple(sorted(LABELS.items()))
    internal_errors = (INTERNAL_ERRORS[0], tuple(sorted({**LABELS, "where": "metrics"}.items())))
    for poll in range(1, 4):
        metrics.count_finished("no_such_reason")
        metrics.record("e2e", 0.5)
        stats.running = poll
        stats.generated_tokens = 10 * poll
        histograms, finished = _published(metrics, stats)
        assert histograms["e2e"] == [0.5] * poll  # published, and the pending ones cleared
        assert _FakeMetricFamily.published[(GAUGES["running"][0], label_key)] == [poll]
        assert sum(_FakeMetricFamily.published[("tritonllm:generation_tokens_total", label_key)]) == 10 * poll
        assert sum(_FakeMetricFamily.published[internal_errors]) == poll
    assert len([r for r in caplog.records if "internal error in metrics" in r.getMessage()]) == 1


def test_prefix_cache_hits_are_counted_by_tier(metrics):
    stats = _Stats()
    for hits in [(0, 0, 0), (32, 16, 0), (48, 16, 64)]:
        stats.prefix_cache_hits = hits
        metrics.update(stats)
    totals = {tier: sum(_FakeMetricFamily.published[
        ("tritonllm:prefix_cache_hits_total", tuple(sorted({**LABELS, "tier": tier}.items())))])
        for tier in ("device", "host", "storage")}
    assert totals == {"device": 48, "host": 16, "storage": 64}
