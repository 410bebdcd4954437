"""Constrained decoding in the engine core: each constrained sequence's llguidance matcher masks the logits
before sampling (`BitmaskFiller` writes the tokens its grammar allows next; EOS only where the grammar accepts)
and `advance` feeds it the chosen token. Matchers come compiled from tritonllm/engine/processing/grammar_compiler.py.
A request's `allowed_token_ids` is a fixed bitmask of its own, combined with its grammar's."""

from __future__ import annotations

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

from tritonllm.engine.core.sequence import Sequence


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask: one bit per token."""
    return (vocab_size + 31) // 32


def allowed_tokens_bitmask(token_ids: list[int], vocab_size: int) -> np.ndarray:
    """[words] int32 with the bits of token_ids set (bit t % 32 of word t // 32). numpy: request processing
    builds it on Triton's thread, where no torch op may run."""
    bits = np.zeros(bitmask_words(vocab_size) * 32, dtype=np.uint8)
    bits[token_ids] = 1
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view("<i4").reshape(-1)


class BitmaskFiller:
    """Fills the next-token bitmasks of a batch's constrained rows, in parallel across sequences."""

    def __init__(self, vocab_size: int):
        self._words = bitmask_words(vocab_size)
        self._executor: LLExecutor | None = None  # llguidance's own thread pool, made on first use

    def fill(self, seqs: list[Sequence]) -> torch.Tensor:
        """[rows, words] int32 on the CPU: the tokens each row's grammar allows next, and of those the ones its
        request's allowed_token_ids allow; other rows allow everything."""
        bitmask = torch.full((len(seqs), self._words), -1, dtype=torch.int32)
        constrained = [(seq.grammar, row) for row, seq in enumerate(seqs) if seq.grammar is not None]
        if constrained:
            if self._executor is None:
                self._executor = LLExecutor()
            # (not llguidance.torch's wrapper: importing that module runs torch.compile)
            self._executor.unsafe_compute_mask_ptr(constrained, bitmask.data_ptr(), self._words * 4, len(seqs))
        for row, seq in enumerate(seqs):
            if seq.request.allowed_tokens is not None:
                bitmask[row] &= torch.from_numpy(seq.request.allowed_tokens)
        return bitmask


def advance(matcher: LLMatcher, token_id: int) -> bool:
    """Feed the sampled token to the sequence's grammar; True when the grammar is complete (nothing but EOS may
    follow). The mask only lets through tokens the grammar accepts, so a refusal is an engine bug."""
    if not matcher.consume_token(token_id):
        raise RuntimeError(f"the grammar refused token {token_id}: {matcher.get_error()}")
    return matcher.is_stopped()
