"""OpenAI's legacy logprobs object and its chat twin, built from the engine's per-token entries.

An engine entry is vllm_backend's: {token id: {"logprob", "rank", "decoded_token"}}, the token itself first, then
its most likely alternatives (once, when the token is one of them). The first token of an echoed prompt has null
logprob and rank: nothing predicts it.
"""

from tritonllm.adapter.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs


def token_of(entry: dict) -> dict:
    """The entry's own token: {"logprob", "rank", "decoded_token"}."""
    return next(iter(entry.values()))


def unscored(token_id: str, text: str) -> dict:
    """The entry of a token nothing predicts (an echoed prompt's first)."""
    return {token_id: {"logprob": None, "rank": None, "decoded_token": text}}


def trimmed(entry: dict, num_top: int) -> dict:
    """The entry with only the token and its num_top most likely alternatives (the engine may have sent more)."""
    own = next(iter(entry))
    return {token_id: value for token_id, value in entry.items()
            if token_id == own or (value["rank"] is not None and value["rank"] <= num_top)}


def vllm_prompt_logprobs(entries: list[dict], num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a prompt: None for its first token (nothing predicts it), then each token's
    entry with its num_top most likely alternatives."""
    return [None, *(trimmed(entry, num_top) for entry in entries[1:])]


def _top_logprobs(entry: dict) -> dict[str, float] | None:
    """OpenAI's top_logprobs of one token: the alternatives and the token itself, most likely first (of two
    tokens with the same text, the more likely one's logprob)."""
    if token_of(entry)["logprob"] is None:
        return None
    top: dict[str, float] = {}
    for value in sorted(entry.values(), key=lambda value: value["rank"]):
        top.setdefault(value["decoded_token"], value["logprob"])
    return top


def as_token_ids(entry: dict) -> dict:
    """The entry with each token named `token_id:<id>` (vLLM's return_tokens_as_token_ids)."""
    return {token_id: {**value, "decoded_token": f"token_id:{token_id}"} for token_id, value in entry.items()}


def completion_logprobs(entries: list[dict], start_offset: int, name_by_id: bool = False
                        ) -> tuple[CompletionLogprobs, int]:
    """Logprobs of consecutive tokens whose text starts `start_offset` characters into the choice's text,
    and the offset just past their text; `name_by_id`: tokens named `token_id:<id>` (the offsets still count
    their texts)."""
    logprobs = CompletionLogprobs()
    offset = start_offset
    for entry in entries:
        named = as_token_ids(entry) if name_by_id else entry
        token = token_of(named)
        logprobs.tokens.append(token["decoded_token"])
        logprobs.token_logprobs.append(token["logprob"])
        logprobs.top_logprobs.append(_top_logprobs(named))
        logprobs.text_offset.append(offset)
        offset += len(token_of(entry)["decoded_token"])
    return logprobs, offset


class LogprobsAccumulator:
    """Logprobs of one choice, arriving in pieces: keeps text offsets running across pieces.

    Offsets count from the start of the choice's text, an echoed prompt included, whose tokens come first.
    """

    def __init__(self, name_by_id: bool = False) -> None:
        self._next_offset = 0
        self._name_by_id = name_by_id
        self.total = CompletionLogprobs()

    def add(self, entries: list[dict]) -> CompletionLogprobs:
        """Record new tokens' entries; returns the logprobs of just these tokens."""
        piece, self._next_offset = completion_logprobs(entries, self._next_offset, self._name_by_id)
        self.total.tokens.extend(piece.tokens)
        self.total.token_logprobs.extend(piece.token_logprobs)
        self.total.top_logprobs.extend(piece.top_logprobs)
        self.total.text_offset.extend(piece.text_offset)
        return piece


def chat_logprobs(legacy: CompletionLogprobs, num_top: int) -> ChatLogprobs:
    """The chat API's shape of generated tokens' logprobs (which, unlike an echoed prompt's, are never null):
    each token's top_logprobs are its num_top most likely alternatives, whether or not it is one of them."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=token,
                logprob=logprob,
                bytes=list(token.encode()),
                top_logprobs=[
                    ChatTopLogprob(token=text, logprob=value, bytes=list(text.encode()))
                    for text, value in list((top or {}).items())[:num_top]
                ],
            )
            for token, logprob, top in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs)
        ]
    )
