"""Incremental detokenization.

Decoding each token alone breaks multi-byte characters and word-boundary spaces, so each step decodes a short
window [prefix_offset, end) and emits only what extends the decode of [prefix_offset, read_offset). Text that
ends in U+FFFD is an incomplete UTF-8 sequence: nothing is emitted until the next token completes it."""

from __future__ import annotations

from backend.engine.sequence import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode_new_text(self, seq: Sequence) -> str:
        skip = seq.params.skip_special_tokens
        window = seq.token_ids[seq.prefix_offset:]
        known = self.tokenizer.decode(window[:seq.read_offset - seq.prefix_offset], skip_special_tokens=skip)
        text = self.tokenizer.decode(window, skip_special_tokens=skip)
        if len(text) <= len(known) or text.endswith("\ufffd"):
            return ""
        seq.prefix_offset, seq.read_offset = seq.read_offset, seq.num_tokens
        return text[len(known):]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
