"""The core's thread (CoreLoop) with the real engine core: admission counted in requests, typed messages, a
failed step or a failed sampling failing only what it must, and the engine-dead state."""

from __future__ import annotations

import threading
import time

import pytest

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.core_loop import CoreLoop
from tritonllm.engine.core.core_messages import AbortRequest, AddRequest
from tritonllm.interface.errors import EngineDead, Overloaded
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import LLMEngine
from engine_helpers import EXACT, assert_idle

MAX_QUEUE_LEN = 3
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    # one running sequence at a time: whatever comes next waits
    return LLMEngine(EngineConfig(model_path=str(default_model_dir), **EXACT, kv_cache_memory=32 << 20,
                                  max_num_seqs=1, max_queue_len=MAX_QUEUE_LEN, max_step_failures=3))


class Loop:
    """A CoreLoop over the engine's core, collecting outputs by request id."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.outputs: dict[str, list] = {}
        self.done = threading.Condition()
        self.loop = CoreLoop(self._collect)
        self.loop.start(lambda: engine.core)

    def _collect(self, outputs) -> None:
        with self.done:
            for output in outputs:
                self.outputs.setdefault(output.request_id, []).append(output)
            self.done.notify_all()

    def submit(self, request_id: str, params: SamplingParams, prompt="Tell me a story.") -> None:
        self.loop.submit(self.engine.inputs.process(request_id, prompt, params))

    def wait_for(self, condition, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def finished(self, request_id: str):
        outputs = self.outputs.get(request_id, [])
        return outputs[-1] if outputs and outputs[-1].finished else None


@pytest.fixture
def loop(engine):
    started = Loop(engine)
    yield started
    started.loop.shutdown(timeout=0.1)
    assert_idle(engine)


def test_waiting_counts_requests_not_sequences(engine):
    request = engine.inputs.process("n8", "Hello", SamplingParams(max_tokens=2, n=8, temperature=1.0))
    engine.core.apply(AddRequest(request))
    assert engine.stats().waiting == 1 and engine.stats().running == 0
    engine.core.step()  # one of the 8 sequences runs (max_num_seqs=1): the request is running, not waiting
    assert engine.stats().waiting == 0 and engine.stats().running == 1
    engine.core.apply(AbortRequest("n8"))
    engine.step()
    assert_idle(engine)


def test_admission_refuses_at_exactly_max_queue_len_requests(loop):
    loop.submit("running", LONG)
    loop.wait_for(lambda: loop.loop.stats.running == 1)
    loop.submit("n8", SamplingParams(max_tokens=2, n=8, temperature=1.0))  # counts once, not 8 times
    loop.submit("b", SHORT)
    loop.submit("c", SHORT)  # the 3rd waiting request: still accepted
    with pytest.raises(Overloaded, match="3 requests waiting"):
        loop.submit("refused", SHORT)
    loop.wait_for(lambda: loop.loop.stats.waiting == MAX_QUEUE_LEN)
    loop.loop.abort("c")
    loop.wait_for(lambda: loop.loop.stats.waiting == MAX_QUEUE_LEN - 1)
    loop.submit("accepted", SHORT)
    loop.loop.abort("running")
    for request_id in ("n8", "b", "accepted"):
        loop.wait_for(lambda: loop.finished(request_id) is not None)
        assert loop.finished(request_id).error is None


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(loop, engine, monkeypatch):
    execute = engine.core.runner.execute
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("transient fault")
        return execute(scheduled)

    monkeypatch.setattr(engine.core.runner, "execute", flaky)
    loop.submit("unlucky", SHORT)
    loop.wait_for(lambda: loop.finished("unlucky") is not None)
    assert "transient fault" in str(loop.finished("unlucky").error)
    loop.submit("lucky", SHORT)
    loop.wait_for(lambda: loop.finished("lucky") is not None)
    assert loop.finished("lucky").error is None and not loop.loop.stats.dead


@pytest.fixture(scope="module")
def pair_engine(default_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(default_model_dir), **EXACT, kv_cache_memory=32 << 20,
                                  max_num_seqs=2))


def test_a_request_whose_sampling_fails_fails_alone(pair_engine, monkeypatch):
    engine = pair_engine
    sampler = engine.core.sampler

    def fragile(logits, seqs):
        if any(seq.request.request_id == "bad" for seq in seqs):
            raise ValueError("bad sampling state")
        return sampler(logits, seqs)

    monkeypatch.setattr(engine.core, "sampler", fragile)
    engine.core.apply(AddRequest(engine.inputs.process("good", "Hello", SHORT)))
    engine.core.apply(AddRequest(engine.inputs.process("bad", "Hello", SHORT)))
    outputs = []
    while engine.core.has_unfinished_requests():
        outputs += engine.core.step()
    [bad] = [o for o in outputs if o.request_id == "bad"]
    assert bad.finished and "bad sampling state" in str(bad.error)
    good = [u.tokens for o in outputs if o.request_id == "good" for u in o.sequences]
    assert sum(map(len, good)) == SHORT.max_tokens and all(o.error is None for o in outputs if o.request_id == "good")
    assert_idle(engine)


def test_a_persistent_fault_kills_the_engine(engine, monkeypatch):
    def broken(scheduled):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.core.runner, "execute", broken)
    dying = Loop(engine)
    for attempt in range(3):  # max_step_failures: the first two fail with the fault itself
        dying.submit(f"r{attempt}", SHORT)
        dying.wait_for(lambda: dying.finished(f"r{attempt}") is not None)
        error = dying.finished(f"r{attempt}").error
        assert isinstance(error, EngineDead) == (attempt == 2), error
    stats = dying.loop.stats
    assert stats.is_dead and "3 steps failed in a row" in stats.dead and "illegal memory access" in stats.dead
    with pytest.raises(EngineDead):  # refused at once, never queued
        dying.submit("late", SHORT)
    dying.loop.shutdown(timeout=0.1)
    assert_idle(engine)
