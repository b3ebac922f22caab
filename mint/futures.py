"""Futures returned by every client method: ``.result()`` blocks, ``await fut`` gives the value."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    """A request's eventual value.

    ``before_wait`` runs before blocking on an unfinished future: the sampling client
    uses it to run every queued request as one batch the first time any result is asked for.
    """

    def __init__(self, future: concurrent.futures.Future, before_wait: Callable[[], None] | None = None):
        self._future = future
        self._before_wait = before_wait

    def result(self, timeout: float | None = None) -> T:
        if not self._future.done() and self._before_wait is not None:
            self._before_wait()
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    async def result_async(self, timeout: float | None = None) -> T:
        if self._future.done():
            return self._future.result()
        return await asyncio.to_thread(self.result, timeout)

    def __await__(self):
        return self.result_async().__await__()
