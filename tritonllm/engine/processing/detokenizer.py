"""Incremental detokenization.

Decoding each token alone breaks multi-byte characters and word-boundary spaces, so each step decodes a short
window [prefix_offset, end) and emits only what extends the decode of [prefix_offset, read_offset). Text that
ends in U+FFFD is an incomplete UTF-8 sequence: nothing is emitted until the next token completes it."""

from __future__ import annotations


class IncrementalDetokenizer:
    """One choice's detokenization state over its token ids (prompt + output)."""

    def __init__(self, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.token_ids = list(prompt_token_ids[-5:])  # the prompt's end: context for the first new token
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.skip_special_tokens = skip_special_tokens

    def add(self, tokenizer, token_id: int, decode: bool = True) -> str:
        """Append a token; the new text it completes (empty while a character is incomplete, or not decoded)."""
        self.token_ids.append(token_id)
        if not decode:
            return ""
        window = self.token_ids[self.prefix_offset:]
        skip = self.skip_special_tokens
        known = tokenizer.decode(window[:self.read_offset - self.prefix_offset], skip_special_tokens=skip)
        text = tokenizer.decode(window, skip_special_tokens=skip)
        if len(text) <= len(known) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(known):]
