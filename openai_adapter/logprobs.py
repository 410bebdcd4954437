"""OpenAI's legacy logprobs object, built from the engine's per-token entries.

An engine entry is {"token": str, "token_id": int, "logprob": float, "top": {token text: logprob}}.
"""

from openai_adapter.protocol import CompletionLogprobs


def completion_logprobs(entries: list[dict], start_offset: int) -> tuple[CompletionLogprobs, int]:
    """Logprobs of consecutive tokens whose text starts `start_offset` characters into the choice's text,
    and the offset just past their text."""
    logprobs = CompletionLogprobs()
    offset = start_offset
    for entry in entries:
        logprobs.tokens.append(entry["token"])
        logprobs.token_logprobs.append(entry["logprob"])
        logprobs.top_logprobs.append(entry["top"])
        logprobs.text_offset.append(offset)
        offset += len(entry["token"])
    return logprobs, offset


class LogprobsAccumulator:
    """Logprobs of one choice, arriving in pieces: keeps text offsets running across pieces."""

    def __init__(self, start_offset: int) -> None:
        self._next_offset = start_offset
        self.total = CompletionLogprobs()

    def add(self, entries: list[dict]) -> CompletionLogprobs:
        """Record new tokens' entries; returns the logprobs of just these tokens."""
        piece, self._next_offset = completion_logprobs(entries, self._next_offset)
        self.total.tokens.extend(piece.tokens)
        self.total.token_logprobs.extend(piece.token_logprobs)
        self.total.top_logprobs.extend(piece.top_logprobs)
        self.total.text_offset.extend(piece.text_offset)
        return piece
