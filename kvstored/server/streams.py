"""The streams a daemon is running, by (session id, stream id), so that one can be ended and waited for.

A client that leaves a stream into its engine buffers early cancels the call, but the daemon
learns of that a little later and may meanwhile copy further blocks into those buffers, which
the engine may already be reusing. ``EndStream`` closes that gap: it stops the stream's task and
returns once the task is over (its copies done or never started).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from kvstored.errors import InvalidArgument

StreamKey = tuple[str, int]


class RunningStreams:
    """``start`` a stream's task under its ids; ``end`` cancels it and waits until it is over.
    Ids ended before their stream started (the call still on its way) are remembered, up to
    ``remember`` of them, and such a stream is cancelled as it starts."""

    def __init__(self, remember: int = 4096) -> None:
        self._running: dict[StreamKey, asyncio.Task[None]] = {}
        self._ended: OrderedDict[StreamKey, None] = OrderedDict()
        self._remember = remember

    def start(self, session_id: str, stream_id: int, task: asyncio.Task[None]) -> bool:
        """Track ``task`` until it is done. False, with ``task`` cancelled, when the stream was
        ended already; InvalidArgument, with ``task`` cancelled, when another running stream of
        the session has the same id."""
        key = (session_id, stream_id)
        if key in self._running:
            task.cancel()
            raise InvalidArgument(f"stream_id {stream_id} is in use by another stream of this session")
        if key in self._ended:
            del self._ended[key]
            task.cancel()
            return False
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))
        return True

    async def end(self, session_id: str, stream_id: int) -> None:
        """Stop the stream and return once its task is over (at once when it is over already)."""
        key = (session_id, stream_id)
        task = self._running.get(key)
        if task is None:
            self._ended[key] = None
            while len(self._ended) > self._remember:
                self._ended.popitem(last=False)
            return
        if not task.cancelling():
            # a second cancel would cut short the stream's own cleanup, which waits (shielded)
            # for the copy in flight: the task would end with the copy still running
            task.cancel()
        await asyncio.wait([task])

    def forget(self, session_id: str) -> None:
        """The session closed: its ended ids can never start a stream again."""
        for key in [k for k in self._ended if k[0] == session_id]:
            del self._ended[key]

    def __len__(self) -> int:
        return len(self._running)
