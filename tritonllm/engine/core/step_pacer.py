"""How much prompt work a step may take while sequences decode: the bound on their inter-token latency.

A prompt chunk batched with decodes lengthens their step, and so every decoding stream's gap between tokens. The
pacer measures the engine's steps: what a step of decodes alone takes, and what a unit of prompt work adds to a
step (the scheduler's unit: a prompt token, weighted by its attention to the context before it). While sequences
decode, a step's prompt chunks may take (max_decode_slowdown - 1) x that step's time in such units, so a step takes
about max_decode_slowdown times a decode step: a long prompt goes on in smaller chunks instead of stalling the
streams, and takes the whole token budget again once nothing decodes. The measurements are moving averages, so
the bound follows the batch as it grows and the contexts lengthen; while a prompt goes on every REFRESH_STEPS-th step
runs the decodes alone, or their time would be the one from before the prompt however their contexts grew (and
their growth charged to the prompt's units). A step's fixed costs (weights read once whatever the chunk) raise the
cost per unit of small chunks, and the chunk settles where the step meets the bound, or at MIN_PROMPT_WORK where
those costs alone exceed it (then the prompt goes on slowly and the bound is not met). Until both are measured, or with max_decode_slowdown 0 (the
default: the chunks' time to first token matters more to most), the token budget alone limits the chunks. Owned by
the core thread, which runs the steps."""

from __future__ import annotations

SMOOTHING = 0.3  # the newest measurement's weight in the moving averages
MIN_PROMPT_WORK = 1  # units a step's prompt chunks may always take: a prompt goes on whatever the measurements say
REFRESH_STEPS = 16  # steps with prompt work between two of decodes alone


class StepPacer:
    def __init__(self, max_decode_slowdown: float):
        self.max_decode_slowdown = max_decode_slowdown
        self.decode_seconds: float | None = None  # a step of decodes alone
        self.seconds_per_unit: float | None = None  # what a unit of prompt work adds to a step with decodes
        self.steps_since_decodes_alone = 0  # steps with decodes and prompt work since decode_seconds was measured

    def observe(self, seconds: float, decodes: int, prompt_work: int) -> None:
        """A step took `seconds` for `decodes` decoding sequences and `prompt_work` units of prompt chunks."""
        if prompt_work == 0:
            if decodes:
                self.decode_seconds = _averaged(self.decode_seconds, seconds)
                self.steps_since_decodes_alone = 0
        elif decodes:
            self.steps_since_decodes_alone += 1
            if self.decode_seconds is not None:
                added = max(seconds - self.decode_seconds, 0.0) / prompt_work
                self.seconds_per_unit = _averaged(self.seconds_per_unit, added)
        elif self.seconds_per_unit is None:  # a first guess: prompts alone run larger chunks, cheaper per unit
            self.seconds_per_unit = seconds / prompt_work

    def prompt_budget(self) -> int | None:
        """Units of prompt work a step with decodes may take (0: decodes alone, to measure them again); None: no
        bound beyond the token budget."""
        if self.max_decode_slowdown <= 0 or self.decode_seconds is None or not self.seconds_per_unit:
            return None
        if self.steps_since_decodes_alone >= REFRESH_STEPS:
            return 0
        extra = (self.max_decode_slowdown - 1) * self.decode_seconds
        return max(MIN_PROMPT_WORK, int(extra / self.seconds_per_unit))


def _averaged(average: float | None, value: float) -> float:
    return value if average is None else average + SMOOTHING * (value - average)
