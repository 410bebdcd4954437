"""The step pacer against a model of an engine's step times: decodes alone take `decode`, a step with prompt work
adds a fixed cost (its forward's pass over the weights) and a cost per unit; the pacer sees only the times."""

from __future__ import annotations

import pytest

from tritonllm.engine.core.step_pacer import MIN_PROMPT_WORK, REFRESH_STEPS, StepPacer


def run(pacer: StepPacer, decode: float, fixed: float, per_unit: float, steps: int = 60,
        prompt_only_first: bool = True, growth: float = 0.0) -> list[tuple[int, float]]:
    """(prompt units, seconds) of each step with decodes, after decode-only steps (and a prompt-only one first:
    a prompt that arrived while nothing decoded, its large chunk cheap per unit); the decodes' own time grows by
    `growth` a step (their contexts lengthen)."""
    for _ in range(5):
        pacer.observe(decode, decodes=8, prompt_work=0)
    if prompt_only_first:
        pacer.observe(fixed + 512 * per_unit, decodes=0, prompt_work=512)
    steps_seen = []
    for step in range(steps):
        budget = pacer.prompt_budget()
        units = 512 if budget is None else min(budget, 512)
        seconds = decode + growth * step + (fixed + per_unit * units if units else 0.0)
        pacer.observe(seconds, decodes=8, prompt_work=units)
        steps_seen.append((units, seconds))
    return steps_seen


def with_prompt(steps: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(units, seconds) for units, seconds in steps if units]


@pytest.mark.parametrize("slowdown", [2.0, 3.0])
def test_steps_with_prompt_work_settle_at_the_slowdown_bound(slowdown):
    decode, fixed, per_unit = 0.020, 0.008, 0.0005
    settled = with_prompt(run(StepPacer(slowdown), decode, fixed, per_unit))[-10:]
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
    assert with_prompt(steps)[-1][0] == MIN_PROMPT_WORK


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


def test_while_a_prompt_goes_on_the_decodes_run_alone_now_and_then_so_their_growth_is_seen():
    """Decodes whose own step grows from 20 to 60 ms over the prompt: the steps with prompt work keep within the
    bound of the decodes' time then, not of their time before the prompt; every REFRESH_STEPS-th step is theirs."""
    steps = run(StepPacer(2.0), decode=0.020, fixed=0.0, per_unit=0.0005, steps=200, growth=0.0002)
    alone = [i for i, (units, _) in enumerate(steps) if units == 0]
    assert alone and all(b - a == REFRESH_STEPS + 1 for a, b in zip(alone, alone[1:]))
    late = [(step, units, seconds) for step, (units, seconds) in enumerate(steps) if step >= 160 and units]
    for step, units, seconds in late:
        assert seconds < 2.0 * (0.020 + 0.0002 * step) * 1.1
    assert min(units for _, units, _ in late) > 10  # the decodes' growth is not charged to the prompt's units
