"""The store's background tasks (promotions, write-backs, buffers closing), so that shutdown
can wait for them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")


class Background:
    """Tasks started by the store's components and not awaited by the request that started them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[object]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def tasks(self) -> list[asyncio.Future[object]]:
        """The tasks in flight now."""
        return list(self._tasks)

    def spawn(self, coro: Coroutine[object, object, T]) -> asyncio.Future[T]:
        """Run ``coro`` as a background task that :meth:`finish` waits for; the task."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)   # type: ignore[arg-type]
        task.add_done_callback(self._tasks.discard)   # type: ignore[arg-type]
        return task

    async def finish(self) -> None:
        """Wait for the tasks in flight (shutdown); their failures are theirs to log."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
