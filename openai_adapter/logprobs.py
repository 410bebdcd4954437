"""OpenAI's legacy logprobs object, built from the engine's per-token entries, and its chat-shaped twin.

An engine entry is {"token": str, "token_id": int, "logprob": float, "top": {token text: logprob}}; the first
token of an echoed prompt has null logprob and top (nothing predicts it).
"""

from openai_adapter.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs


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
    """Logprobs of one choice, arriving in pieces: keeps text offsets running across pieces.

    Offsets count from the start of the choice's text, an echoed prompt included, whose tokens come first.
    """

    def __init__(self) -> None:
        self._next_offset = 0
        self.total = CompletionLogprobs()

    def add(self, entries: list[dict]) -> CompletionLogprobs:
        """Record new tokens' entries; returns the logprobs of just these tokens."""
        piece, self._next_offset = completion_logprobs(entries, self._next_offset)
        self.total.tokens.extend(piece.tokens)
        self.total.token_logprobs.extend(piece.token_logprobs)
        self.total.top_logprobs.extend(piece.top_logprobs)
        self.total.text_offset.extend(piece.text_offset)
        return piece


def chat_logprobs(legacy: CompletionLogprobs) -> ChatLogprobs:
    """The chat API's shape of generated tokens' logprobs (which, unlike an echoed prompt's, are never null)."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=token,
                logprob=logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    ChatTopLogprob(token=text, logprob=value, bytes=list(text.encode()))
                    for text, value in (top or {}).items()
                ],
            )
            for token, logprob, top in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs)
        ]
    )
