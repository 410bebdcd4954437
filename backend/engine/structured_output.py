"""Constrained decoding in the engine core: each constrained sequence's llguidance matcher masks the logits
before sampling (`BitmaskFiller` writes the tokens its grammar allows next; EOS only where the grammar accepts)
and `advance` feeds it the chosen token. Matchers come compiled from backend/processing/grammar_compiler.py."""

from __future__ import annotations

import torch
from llguidance import LLExecutor, LLMatcher


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask: one bit per token."""
    return (vocab_size + 31) // 32


class BitmaskFiller:
    """Fills the next-token bitmasks of a batch's constrained rows, in parallel across sequences."""

    def __init__(self, vocab_size: int):
        self._words = bitmask_words(vocab_size)
        self._executor: LLExecutor | None = None  # llguidance's own thread pool, made on first use

    def fill(self, matchers: list[LLMatcher | None]) -> torch.Tensor:
        """[rows, words] int32 on the CPU: each constrained row's allowed tokens; other rows allow everything."""
        bitmask = torch.full((len(matchers), self._words), -1, dtype=torch.int32)
        constrained = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
        if constrained:
            if self._executor is None:
                self._executor = LLExecutor()
            # (not llguidance.torch's wrapper: importing that module runs torch.compile)
            self._executor.unsafe_compute_mask_ptr(constrained, bitmask.data_ptr(), self._words * 4, len(matchers))
        return bitmask


def advance(matcher: LLMatcher, token_id: int) -> bool:
    """Feed the sampled token to the sequence's grammar; True when the grammar is complete (nothing but EOS may
    follow). The mask only lets through tokens the grammar accepts, so a refusal is an engine bug."""
    if not matcher.consume_token(token_id):
        raise RuntimeError(f"the grammar refused token {token_id}: {matcher.get_error()}")
    return matcher.is_stopped()
