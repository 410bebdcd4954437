"""What `echo` puts before each choice's text: the prompt, and with `logprobs` its tokens' logprobs.

A text prompt echoes itself. A token-id prompt echoes its decoded text, which only the engine can give (the
adapter has no tokenizer): the token texts of the engine's prompt logprobs, which are therefore requested for
token-id prompts even when the client asked for no logprobs.
"""

from dataclasses import dataclass

from openai_adapter.protocol import GenerationRequest


@dataclass(frozen=True)
class Echo:
    text: str
    logprobs: list[dict]
    """Engine-format entries of the prompt's tokens (the first with null logprob and top: nothing predicts
    it); empty when the client asked for no logprobs."""


def engine_prompt_logprobs(request: GenerationRequest) -> int | None:
    """The `prompt_logprobs` the engine must return for the request's echo; None when echo needs none."""
    if not request.echo:
        return None
    if request.logprobs is not None:
        return request.logprobs
    return 0 if request.has_token_id_prompts() else None


def echo_from_prompt_logprobs(prompt: str | list[int], prompt_logprobs: list[dict | None], with_logprobs: bool) -> Echo:
    """The echo of a prompt built from the engine's prompt logprobs (one entry per prompt token)."""
    first, later = prompt_logprobs[0], prompt_logprobs[1:]
    later_text = "".join(entry["token"] for entry in later)
    if isinstance(prompt, str):
        text = prompt
        # The engine's first entry is null (nothing predicts the first token), so its text is what the other
        # tokens leave of the prompt; "" when their texts do not end the prompt (e.g. a split UTF-8 character).
        first_text = prompt.removesuffix(later_text) if prompt.endswith(later_text) else ""
    else:
        # A token-id prompt has no text to take the first token's from: only an engine first entry that carries
        # the token's text can give it (a null one leaves it out of the echo).
        first_text = (first or {}).get("token", "")
        text = first_text + later_text
    if not with_logprobs:
        return Echo(text, [])
    return Echo(text, [{"token": first_text, "logprob": None, "top": None}, *later])
