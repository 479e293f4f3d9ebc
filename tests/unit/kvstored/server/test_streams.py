"""RunningStreams: EndStream stops a stream and returns only once its task (its cleanup too) is over."""

from __future__ import annotations

import asyncio

from kvstored.server.streams import RunningStreams
from kvstored_client.contract.errors import FailedPrecondition, InvalidArgument


async def _stream(cleanup: list[str], cleanup_s: float = 0.05) -> None:
    """A stream that, cancelled, waits for its copy in flight (shielded) before it ends."""
    try:
        await asyncio.sleep(10)
    finally:
        copy = asyncio.ensure_future(asyncio.sleep(cleanup_s))
        try:
            await asyncio.shield(copy)
        finally:
            cleanup.append("done" if copy.done() else "cut short")


def test_end_returns_once_the_stream_and_its_cleanup_are_over() -> None:
    async def main() -> list[str]:
        streams, cleanup = RunningStreams(), []
        task = asyncio.ensure_future(_stream(cleanup))
        assert streams.start("s", 1, task)
        await asyncio.sleep(0)
        await streams.end("s", 1)
        assert task.done() and len(streams) == 0
        return cleanup

    assert asyncio.run(main()) == ["done"]


def test_ending_a_stream_already_being_cancelled_does_not_cut_its_cleanup_short() -> None:
    """The call's own cancellation (the client cancelled it) came first: a second cancel from
    EndStream broke the shielded wait for the copy, and EndStream returned with it still running."""
    async def main() -> list[str]:
        streams, cleanup = RunningStreams(), []
        task = asyncio.ensure_future(_stream(cleanup))
        assert streams.start("s", 1, task)
        await asyncio.sleep(0)
        task.cancel()               # the call's end
        await asyncio.sleep(0.01)   # its cleanup is waiting for the copy
        await streams.end("s", 1)
        assert task.done()
        return cleanup

    assert asyncio.run(main()) == ["done"]


def test_a_stream_ended_before_it_started_is_cancelled_as_it_starts_and_ids_are_not_shared() -> None:
    async def main() -> tuple[bool, bool, str, bool]:
        streams, cleanup = RunningStreams(), []
        await streams.end("s", 7)   # the call is still on its way
        early = asyncio.ensure_future(_stream(cleanup, 0))
        started_early = streams.start("s", 7, early)
        first = asyncio.ensure_future(_stream(cleanup, 0))
        second = asyncio.ensure_future(_stream(cleanup, 0))
        started_first = streams.start("s", 8, first)
        try:
            streams.start("s", 8, second)   # same id, still running
            started_second = "started"
        except InvalidArgument:
            started_second = "refused"
        assert second.cancelled() or second.cancelling()
        await asyncio.wait([early, second])
        other_session = asyncio.ensure_future(_stream(cleanup, 0))
        started_other = streams.start("t", 8, other_session)
        for task in (first, other_session):
            task.cancel()
        await asyncio.wait([first, other_session])
        return started_early, started_first, started_second, started_other

    assert asyncio.run(main()) == (False, True, "refused", True)


def test_a_closed_session_forgets_its_ended_ids_and_memory_is_bounded() -> None:
    async def main() -> tuple[bool, bool]:
        streams = RunningStreams(remember=2)
        await streams.end("s", 1)
        streams.forget("s")
        task = asyncio.ensure_future(asyncio.sleep(10))
        forgotten = streams.start("s", 1, task)
        for i in range(3):
            await streams.end("u", 100 + i)   # only the last two are remembered
        old = asyncio.ensure_future(asyncio.sleep(10))
        oldest_remembered = not streams.start("u", 100, old)
        for t in (task, old):
            t.cancel()
        await asyncio.wait([task, old])
        return forgotten, oldest_remembered

    assert asyncio.run(main()) == (True, False)


def test_a_session_that_ends_many_unknown_streams_does_not_push_out_another_sessions_ended_id() -> None:
    """The ids ended before their stream started were bounded for all sessions together: a client
    ending thousands of ids it never started made the daemon forget another client's EndStream,
    whose stream then ran into buffers that client was already reusing."""
    async def main() -> bool:
        streams = RunningStreams(remember=4)
        await streams.end("careful", 7)
        for i in range(100):
            await streams.end("noisy", i)
        task = asyncio.ensure_future(asyncio.sleep(10))
        started = streams.start("careful", 7, task)
        task.cancel()
        await asyncio.wait([task])
        return started

    assert asyncio.run(main()) is False, "the careful session's ended stream ran"


def test_ending_a_stream_of_an_unknown_session_is_refused_unless_it_is_still_running() -> None:
    """Remembered per session, the ids of sessions that do not exist would be kept for ever; a
    stream still running under a session that has just closed is still stopped and waited for."""
    async def main() -> list[str]:
        streams = RunningStreams()
        try:
            await streams.end("gone", 1, session_open=False)
        except FailedPrecondition:
            pass
        else:
            raise AssertionError("an id of an unknown session was taken")
        assert streams.start("gone", 1, asyncio.ensure_future(asyncio.sleep(0)))   # nothing was remembered
        cleanup: list[str] = []
        task = asyncio.ensure_future(_stream(cleanup))
        assert streams.start("closing", 2, task)
        await asyncio.sleep(0)
        await streams.end("closing", 2, session_open=False)
        assert task.done()
        return cleanup

    assert asyncio.run(main()) == ["done"]
