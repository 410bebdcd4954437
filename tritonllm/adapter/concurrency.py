"""Asyncio plumbing that carries cancellation down to the Triton streams."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from tritonllm.adapter.errors import client_disconnected

T = TypeVar("T")

DISCONNECT_POLL_INTERVAL_S = 0.2

_FINISHED = object()


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they arrive, each tagged with its iterator's position.

    Each iterator runs in its own task, so leaving this generator early, or the first failure (which is
    re-raised here), cancels every task still running and so closes its iterator. A lone iterator (most
    requests) is read in place: no task, no queue between its items and the caller.
    """
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
        except Exception as error:
            queue.put_nowait(error)
        else:
            queue.put_nowait(_FINISHED)

    tasks = [asyncio.create_task(forward(index, iterator)) for index, iterator in enumerate(iterators)]
    try:
        running = len(tasks)
        while running:
            message = await queue.get()
            if message is _FINISHED:
                running -= 1
            elif isinstance(message, Exception):
                raise message
            else:
                yield message
    finally:
        for task in tasks:
            task.cancel()


async def cancel_on_disconnect(work: Awaitable[T], is_disconnected: Callable[[], Awaitable[bool]]) -> T:
    """Await `work`, polling the client; when it has gone, cancel `work` and raise client_disconnected().

    Needed wherever no response bytes flow yet (a non-streamed completion, the first chunk of a stream):
    without writes, nothing else notices the client leaving.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_INTERVAL_S)
            if done:
                return task.result()
            if await is_disconnected():
                raise client_disconnected()
    finally:
        task.cancel()
