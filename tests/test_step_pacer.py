"""The step pacer against a model of an engine's step times: decodes alone take `decode`, a step with prompt work
adds a fixed cost (its forward's pass over the weights) and a cost per unit; the pacer sees only the times."""

from __future__ import annotations

import pytest

from tritonllm.engine.core.step_pacer import MIN_PROMPT_WORK, StepPacer


def run(pacer: StepPacer, decode: float, fixed: float, per_unit: float, steps: int = 60,
        prompt_only_first: bool = True) -> list[tuple[int, float]]:
    """(prompt units, seconds) of each step with decodes, after decode-only steps (and a prompt-only one first:
    a prompt that arrived while nothing decoded, its large chunk cheap per unit)."""
    for _ in range(5):
        pacer.observe(decode, decodes=8, prompt_work=0)
    if prompt_only_first:
        pacer.observe(fixed + 512 * per_unit, decodes=0, prompt_work=512)
    steps_seen = []
    for _ in range(steps):
        budget = pacer.prompt_budget()
        units = 512 if budget is None else min(budget, 512)
        seconds = decode + fixed + per_unit * units
        pacer.observe(seconds, decodes=8, prompt_work=units)
        steps_seen.append((units, seconds))
    return steps_seen


@pytest.mark.parametrize("slowdown", [2.0, 3.0])
def test_steps_with_prompt_work_settle_at_the_slowdown_bound(slowdown):
    decode, fixed, per_unit = 0.020, 0.008, 0.0005
    settled = run(StepPacer(slowdown), decode, fixed, per_unit)[-10:]
    for units, seconds in settled:
        assert seconds == pytest.approx(slowdown * decode, rel=0.05)
    # the chunk the bound leaves: what the fixed cost does not take
    assert settled[-1][0] == pytest.approx(((slowdown - 1) * decode - fixed) / per_unit, rel=0.05)


def test_the_first_steps_after_a_prompt_alone_overshoot_then_come_back_within_a_few():
    """A prompt-only step's cost per unit is a first guess that is too low (its fixed cost spread over 512)."""
    steps = run(StepPacer(2.0), decode=0.020, fixed=0.010, per_unit=0.0002)
    over = [i for i, (_, seconds) in enumerate(steps) if seconds > 2.0 * 0.020 * 1.1]
    assert over and max(over) < 8


def test_a_fixed_cost_over_the_bound_leaves_the_minimum_so_the_prompt_goes_on():
    steps = run(StepPacer(2.0), decode=0.020, fixed=0.030, per_unit=0.0005)
    assert steps[-1][0] == MIN_PROMPT_WORK


def test_no_bound_until_decodes_alone_were_measured_or_when_off():
    pacer = StepPacer(2.0)
    pacer.observe(0.1, decodes=0, prompt_work=512)
    pacer.observe(0.2, decodes=8, prompt_work=512)  # no decode-only step yet: nothing to subtract
    assert pacer.prompt_budget() is None
    off = StepPacer(0)
    run(off, decode=0.020, fixed=0.010, per_unit=0.0005, steps=3)
    assert off.prompt_budget() is None


def test_the_bound_follows_the_decode_steps_as_they_lengthen():
    pacer = StepPacer(2.0)
    run(pacer, decode=0.020, fixed=0.0, per_unit=0.0005, prompt_only_first=False)
    before = pacer.prompt_budget()
    for _ in range(20):
        pacer.observe(0.040, decodes=16, prompt_work=0)
    assert pacer.prompt_budget() == pytest.approx(2 * before, rel=0.05)
