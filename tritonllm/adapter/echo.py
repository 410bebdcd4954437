"""What `echo` puts before each choice's text: the prompt, and with `logprobs` its tokens' logprobs.

A text prompt echoes itself. A token-id prompt echoes its decoded text, which only the engine can give (the
adapter has no tokenizer): the token texts of the engine's prompt logprobs, which are therefore requested for
token-id prompts even when the client asked for no logprobs.
"""

from dataclasses import dataclass

from tritonllm.adapter.logprobs import token_of, trimmed, unscored
from tritonllm.adapter.protocol import GenerationRequest


@dataclass(frozen=True)
class Echo:
    text: str
    logprobs: list[dict]
    """Engine entries of the prompt's tokens (the first with null logprob and rank: nothing predicts it);
    empty when the client asked for no logprobs."""


def echo_prompt_logprobs(request: GenerationRequest) -> int | None:
    """The `prompt_logprobs` the engine must return for the request's echo; None when echo needs none."""
    if not (request.echo and request.echoes_prompt):
        return None
    if request.logprobs is not None:
        return request.logprobs
    return 0 if request.has_token_id_prompts() else None


def echo_from_prompt_logprobs(prompt: str | list[int], prompt_logprobs: list[dict], logprobs: int | None) -> Echo:
    """The echo of a prompt built from the engine's prompt logprobs (one entry per prompt token), with the
    request's `logprobs` alternatives per token (None: no logprobs)."""
    first, later = prompt_logprobs[0], prompt_logprobs[1:]
    later_text = "".join(token_of(entry)["decoded_token"] for entry in later)
    if isinstance(prompt, str):
        text = prompt
        # Nothing predicts the first token, so its text is what the other tokens leave of the prompt; "" when
        # their texts do not end the prompt (e.g. a split UTF-8 character).
        first_text = prompt.removesuffix(later_text) if prompt.endswith(later_text) else ""
    else:
        # A token-id prompt has no text to take the first token's from but the engine's first entry.
        first_text = token_of(first)["decoded_token"]
        text = first_text + later_text
    if logprobs is None:
        return Echo(text, [])
    return Echo(text, [unscored(next(iter(first)), first_text), *(trimmed(entry, logprobs) for entry in later)])
