"""Server-sent events framing of a streamed completion or chat completion."""

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from tritonllm.adapter.errors import AdapterError, internal_error, log_server_error
from tritonllm.adapter.protocol import ChatCompletionChunk, CompletionResponse

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"

Chunk = CompletionResponse | ChatCompletionChunk


def data_event(data: str) -> str:
    return f"data: {data}\n\n"


def chunk_event(chunk: Chunk) -> str:
    # Like OpenAI, chunks that carry no usage leave the field out; like vLLM, chunks have no prompt_logprobs.
    exclude = {"choices": {"__all__": {"prompt_logprobs"}}, **({"usage": True} if chunk.usage is None else {})}
    return data_event(chunk.model_dump_json(exclude=exclude))


def error_event(error: AdapterError) -> str:
    return data_event(json.dumps(error.body()))


async def resumed(first: Chunk, rest: AsyncGenerator[Chunk, None]) -> AsyncIterator[Chunk]:
    """A stream whose first chunk was taken already (to answer its errors with a status), whole again; closing
    this generator closes `rest` (and so its Triton calls). Every API's framing of a stream reads it so."""
    async with aclosing(rest):
        yield first
        async for chunk in rest:
            yield chunk


async def completion_events(
    first: Chunk, rest: AsyncGenerator[Chunk, None]
) -> AsyncIterator[str]:
    """Events of a stream whose first chunk is already known; a later failure becomes an error event.

    The stream always ends with [DONE]; closing this generator closes `rest` (and so its Triton calls).
    """
    try:
        async with aclosing(resumed(first, rest)) as chunks:
            async for chunk in chunks:
                yield chunk_event(chunk)
    except AdapterError as error:
        log_server_error(error)
        yield error_event(error)
    except Exception:
        logger.exception("unexpected error while streaming a completion")
        yield error_event(internal_error())
    yield DONE_EVENT
