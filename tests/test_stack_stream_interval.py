"""`--stream-interval` through the whole stack, with the official openai SDK and tritonclient: streamed choices
arrive in chunks of that many tokens (the first response at once, the last when the choice ends), their text is the
whole greedy text, and the token counts still add up."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from stack_helpers import Stack, grpc_generate, running_stack

INTERVAL = 4
TOKENS = 18
PROMPT = "Write a short poem about the moon."


@pytest.fixture(scope="module")
def interval_stack(default_model_dir, tmp_path_factory) -> Iterator[Stack]:
    with running_stack(default_model_dir, tmp_path_factory.mktemp("interval-stack"), "--stream-interval",
                       str(INTERVAL), "--max-num-seqs", "8", "--kv-cache-memory", "128MiB") as started:
        yield started.stack


def _sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=600)


def test_streamed_choices_arrive_in_chunks_of_the_interval(interval_stack):
    client = _sdk(interval_stack)
    whole = client.completions.create(model=interval_stack.model_name, prompt=PROMPT, max_tokens=TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    chunks, usage = [], None
    for chunk in client.completions.create(
            model=interval_stack.model_name, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True}):
        if chunk.choices:
            chunks.append((chunk.choices[0].text, chunk.usage.completion_tokens))
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(text for text, _ in chunks) == whole.choices[0].text
    counts = [count for _, count in chunks]
    _assert_chunked([later - earlier for earlier, later in zip([0] + counts, counts)])
    assert usage.completion_tokens == TOKENS


def _assert_chunked(sizes: list[int]) -> None:
    """Tokens per response: the first goes out at once (after any the detokenizer holds back: a token may end
    mid-character), then whole intervals, and the last with what is left."""
    assert sum(sizes) == TOKENS
    assert 1 <= sizes[0] <= INTERVAL and 1 <= sizes[-1] <= INTERVAL
    assert sizes[1:-1] == [INTERVAL] * (len(sizes) - 2)


def test_tritonclient_sees_the_same_chunks(interval_stack):
    responses, error = grpc_generate(interval_stack, PROMPT, {"max_tokens": TOKENS, "temperature": 0,
                                                              "ignore_eos": True}, True, return_num_output_tokens=True)
    assert error is None
    _assert_chunked([int(r.as_numpy("num_output_tokens")[0]) for r in responses])
