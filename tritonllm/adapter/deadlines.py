"""The deadline of a whole generation request: the server's request_timeout_s (unset by default: a generation may
take as long as it keeps producing, which the Triton client's idle timeout watches), or less when the request's
own `X-Request-Timeout` header (seconds) asks for less. Past it, the request fails with 504: a stream with an
error event, its Triton requests cancelled."""

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from starlette.datastructures import Headers

from tritonllm.adapter.errors import AdapterError, gateway_timeout, invalid_request
from tritonllm.adapter.settings import AdapterSettings

T = TypeVar("T")

REQUEST_TIMEOUT_HEADER = "X-Request-Timeout"


def request_deadline(headers: Headers, settings: AdapterSettings) -> float | None:
    """Seconds the request may take (the smaller of the server's limit and the header's), or None for no limit."""
    raw = headers.get(REQUEST_TIMEOUT_HEADER)
    if raw is None:
        return settings.request_timeout_s
    try:
        asked = float(raw)
    except ValueError:
        asked = math.nan
    if not math.isfinite(asked) or asked <= 0:
        raise invalid_request(f"The {REQUEST_TIMEOUT_HEADER} header must be a positive number of seconds, not "
                              f"{raw!r}.", REQUEST_TIMEOUT_HEADER)
    return asked if settings.request_timeout_s is None else min(asked, settings.request_timeout_s)


def _exceeded(seconds: float) -> AdapterError:
    return gateway_timeout(f"The request did not finish within its deadline of {seconds:g} s.")


async def within(work: Awaitable[T], seconds: float | None) -> T:
    """Await `work`; past `seconds`, cancel it and raise 504."""
    if seconds is None:
        return await work
    try:
        return await asyncio.wait_for(work, seconds)
    except asyncio.TimeoutError:
        raise _exceeded(seconds) from None


async def stream_within(chunks: AsyncGenerator[T, None], seconds: float | None) -> AsyncIterator[T]:
    """The chunks until `seconds` have passed since the first was asked for; then 504 (and `chunks` closed)."""
    async with aclosing(chunks):
        if seconds is None:
            async for chunk in chunks:
                yield chunk
            return
        deadline = asyncio.get_running_loop().time() + seconds
        while True:
            try:
                chunk = await asyncio.wait_for(anext(chunks), deadline - asyncio.get_running_loop().time())
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise _exceeded(seconds) from None
            yield chunk
