"""The streams a daemon is running, by (session id, stream id), so that one can be ended and waited for.

A client that leaves a stream into its engine buffers early cancels the call, but the daemon
learns of that a little later and may meanwhile copy further blocks into those buffers, which
the engine may already be reusing. ``EndStream`` closes that gap: it stops the stream's task and
returns once the task is over (its copies done or never started).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from kvstored_client.contract.errors import FailedPrecondition, InvalidArgument, Reason

StreamKey = tuple[str, int]


class RunningStreams:
    """``start`` a stream's task under its ids; ``end`` cancels it and waits until it is over.
    Ids ended before their stream started (the call still on its way) are remembered, up to
    ``remember`` of them per session (one session ending many cannot push out another's), and
    such a stream is cancelled as it starts."""

    def __init__(self, remember: int = 4096) -> None:
        self._running: dict[StreamKey, asyncio.Task[None]] = {}
        self._ended: dict[str, OrderedDict[int, None]] = {}
        self._remember = remember

    def start(self, session_id: str, stream_id: int, task: asyncio.Task[None]) -> bool:
        """Track ``task`` until it is done. False, with ``task`` cancelled, when the stream was
        ended already; InvalidArgument, with ``task`` cancelled, when another running stream of
        the session has the same id."""
        key = (session_id, stream_id)
        if key in self._running:
            task.cancel()
            raise InvalidArgument(f"stream_id {stream_id} is in use by another stream of this session")
        ended = self._ended.get(session_id)
        if ended is not None and stream_id in ended:
            del ended[stream_id]
            if not ended:
                del self._ended[session_id]
            task.cancel()
            return False
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))
        return True

    async def end(self, session_id: str, stream_id: int, session_open: bool = True) -> None:
        """Stop the stream and return once its task is over (at once when it is over already).
        A stream not running is remembered as ended only for an open session: for any other,
        FailedPrecondition (ids of sessions that do not exist would be kept for ever)."""
        key = (session_id, stream_id)
        task = self._running.get(key)
        if task is None:
            if not session_open:
                raise FailedPrecondition(f"unknown session {session_id!r}: its streams ended with it",
                                         Reason.UNKNOWN_SESSION)
            ended = self._ended.setdefault(session_id, OrderedDict())
            ended[stream_id] = None
            while len(ended) > self._remember:
                ended.popitem(last=False)
            return
        if not task.cancelling():
            # a second cancel would cut short the stream's own cleanup, which waits (shielded)
            # for the copy in flight: the task would end with the copy still running
            task.cancel()
        await asyncio.wait([task])

    def forget(self, session_id: str) -> None:
        """The session closed: its ended ids can never start a stream again."""
        self._ended.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._running)
