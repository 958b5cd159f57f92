"""Futures of the client API, with Tinker's semantics.

- ``APIFuture[T]``: what every training and sampling call returns at once. It is a
  ``concurrent.futures.Future`` (``result(timeout)``, ``add_done_callback``, ``wait``,
  ``asyncio.wrap_future`` all work) that can also be awaited: ``await fut`` or
  ``await fut.result_async(timeout)``.
- ``submit(executor, fn)``: run ``fn`` on ``executor``, answering an ``APIFuture``.
- ``ReadyClient``: the clients themselves. Tinker's client-creating calls return a future of the
  new client; polytinker's return the client, which answers ``.result()`` and ``await`` with
  itself, so code written either way runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from concurrent.futures import Executor, Future
from typing import Any, Self, TypeVar

T = TypeVar("T")


class APIFuture(Future[T]):
    """A ``concurrent.futures.Future`` that is also awaitable (Tinker's ``APIFuture``)."""

    async def result_async(self, timeout: float | None = None) -> T:
        """The result, awaited; ``TimeoutError`` after ``timeout`` seconds (the call goes on).
        Cancelling the awaiting task without a timeout cancels a call still queued, as
        ``asyncio.wrap_future`` does."""
        if timeout is None:
            return await asyncio.wrap_future(self)
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self)), timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def future(self) -> Future[T]:
        """This future as a plain ``concurrent.futures.Future`` (it is one)."""
        return self

    async def coroutine(self) -> T:
        """The future as a coroutine (for ``asyncio.create_task``)."""
        return await self.result_async()


def submit(executor: Executor, fn: Callable[[], T]) -> APIFuture[T]:
    """Run ``fn`` on ``executor``; its result or error lands in the returned future."""
    fut: APIFuture[T] = APIFuture()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return  # cancelled while queued
        try:
            fut.set_result(fn())
        except BaseException as exc:  # the caller sees every error, as a plain executor would show it
            fut.set_exception(exc)

    executor.submit(run)
    return fut


class ReadyClient:
    """A client that is its own (finished) future: ``client.result()`` and ``await client`` give it back."""

    def result(self, timeout: float | None = None) -> Self:
        return self

    async def result_async(self, timeout: float | None = None) -> Self:
        return self

    def __await__(self) -> Generator[Any, None, Self]:
        return self.result_async().__await__()


__all__ = ["APIFuture", "ReadyClient", "submit"]
