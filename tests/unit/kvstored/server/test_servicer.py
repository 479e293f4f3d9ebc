"""The servicer's StreamBlocks loop, in process, against a stand-in store: how a stream that fails
midway ends (the blocks already in place still reach the client, then the call ends with the error,
never a hang)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from unretrieved import unretrieved_errors

from kvstored.handover import Arrival
from kvstored.index import Tier
from kvstored.server.servicer import KVStoreServicer
from kvstored_client.contract.errors import FailedPrecondition, NotFound
from kvstored_client.contract.proto import kvstored_pb2 as pb


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Context:
    """What StreamBlocks uses of grpc.aio.ServicerContext: abort raises, as grpc's does."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None   # no deadline


class FailingStore:
    """A store whose ``stream_blocks`` (the chain streamer's) places two blocks, then fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def stream_blocks(self, session_id: str, namespace_id: int, keys: Any, buffers_id: int,
                            block_ids: Any, emit: Callable[[Arrival], None], fetcher: Any,
                            on_lease: Callable[[int], None] | None = None, copy_until: float | None = None) -> Any:
        emit(Arrival(0, Tier.DRAM))
        emit(Arrival(1, Tier.DRAM))
        await asyncio.sleep(0)
        raise self.error


async def collect(servicer: KVStoreServicer) -> tuple[list[int], BaseException | None]:
    got: list[int] = []
    try:
        async with asyncio.timeout(5):   # a hang fails the test instead of stalling the suite
            async for event in servicer.StreamBlocks(pb.StreamBlocksRequest(session_id="s"), Context()):  # type: ignore[arg-type]
                got.extend(b.index for b in event.blocks)
    except (Aborted, RuntimeError) as exc:
        return got, exc
    return got, None


@pytest.mark.parametrize("error", [NotFound("the session ended"), RuntimeError("a bug")], ids=["kv-error", "bug"])
def test_a_stream_failing_midway_delivers_what_is_in_place_then_ends_with_the_error(error: Exception) -> None:
    failing = FailingStore(error)
    servicer = KVStoreServicer(failing, None, 30.0, 64, asyncio.Event(), streamer=failing)  # type: ignore[arg-type]
    got, exc = asyncio.run(collect(servicer))
    assert got == [0, 1]
    if isinstance(error, NotFound):
        assert isinstance(exc, Aborted) and exc.code == grpc.StatusCode.NOT_FOUND and "session" in str(exc)
    else:
        assert exc is error


def test_a_stream_from_a_silent_peer_ends_before_the_callers_deadline() -> None:
    """With the defaults, peers.deadline_s and the SDK's timeout_s are both 30 s, and the fetch's
    deadline starts after the call's: a peer that went silent mid-transfer made every stream and
    pull fail with DEADLINE_EXCEEDED (an error, the blocks in place not accounted for) instead of
    the short outcome ("timeout") the README promises. The transfer now ends before the caller's
    deadline (here 2 s, with peers.deadline_s at 30 s)."""
    from silent_peer import node_with_a_silent_peer

    from kvstored_client.contract.hashing import block_hashes
    from kvstored_client.contract.namespace import Namespace

    class DeadlineContext(Context):
        def time_remaining(self) -> float:
            return 2.0

    async def main() -> pb.BlockStreamEnd:
        async with node_with_a_silent_peer(Namespace(model="m", block_bytes=4096),
                                           deadline_s=30.0, lookup_timeout_s=30.0) as b:
            servicer = KVStoreServicer(b.store, b.arena, 30.0, 64, asyncio.Event(), b.peers)
            session = b.store.open_session("decode", 1).session_id
            request = pb.StreamBlocksRequest(session_id=session, namespace_id=b.namespace_id, peers=True,
                                             end_only=True)
            request.keys.hashes.extend(block_hashes(list(range(32))))
            async with asyncio.timeout(10):   # a hang fails the test instead of stalling the suite
                async for event in servicer.StreamBlocks(request, DeadlineContext()):  # type: ignore[arg-type]
                    if event.HasField("end"):
                        return event.end
            raise AssertionError("no end")

    end = asyncio.run(main())
    assert end.blocks == 0 and end.stop != "complete", end


class SessionContext:
    """What Session uses of grpc.aio.ServicerContext: the client's messages come from a queue
    (``grpc.aio.EOF`` when the client ends its side), the daemon's events are kept."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[object] = asyncio.Queue()
        self.written: list[pb.SessionEvent] = []

    async def read(self) -> object:
        return await self.incoming.get()

    async def write(self, event: pb.SessionEvent) -> None:
        self.written.append(event)


class SessionStore:
    """The store's session calls, recorded."""

    spare_bytes = 0

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list[str] = []

    def open_session(self, client_name: str, pid: int) -> Any:
        from kvstored.leases import Session

        self.opened.append(f"s{len(self.opened)}")
        return Session(self.opened[-1], client_name, pid)

    def close_session(self, session_id: str) -> None:
        self.closed.append(session_id)


class StubArena:
    path = "/dev/shm/kvstored-test-arena"
    capacity = 1 << 20


async def settle() -> None:
    """Let the handler run until it waits on its client (a bounded number of loop turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_session_whose_client_went_away_leaves_no_task_behind() -> None:
    """(review) A client that dies, or an SDK that closes (it cancels the call), cancels the
    Session handler while it waits for the client's next message or the daemon's shutdown: the
    two tasks it waited on were cancelled only on the other paths, so the one waiting for the
    shutdown event stayed pending for the daemon's lifetime, one more for every session ever
    closed that way."""

    async def main() -> list[asyncio.Task[Any]]:
        store = SessionStore()
        servicer = KVStoreServicer(store, StubArena(), 30.0, 64, asyncio.Event())  # type: ignore[arg-type]
        context = SessionContext()
        context.incoming.put_nowait(pb.SessionRequest(client_name="engine", pid=1))
        call = asyncio.ensure_future(servicer.Session(None, context))  # type: ignore[arg-type]
        await settle()
        assert [e.session_id for e in context.written] == ["s0"]
        call.cancel()   # the client went away
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await settle()
        assert store.closed == ["s0"]
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]

    assert asyncio.run(main()) == []


def test_a_session_lasts_until_its_client_ends_its_side_whatever_else_it_sends() -> None:
    """(review) The handler took any second message on the stream for its end: a client that sent
    one more SessionRequest (a raw client saying hello again, a keep-alive) lost its session,
    and with it its leases, reservations and buffers, while still using them."""

    async def main() -> None:
        store = SessionStore()
        servicer = KVStoreServicer(store, StubArena(), 30.0, 64, asyncio.Event())  # type: ignore[arg-type]
        context = SessionContext()
        context.incoming.put_nowait(pb.SessionRequest(client_name="engine", pid=1))
        context.incoming.put_nowait(pb.SessionRequest(client_name="engine", pid=1))
        async with asyncio.timeout(5):   # a hang fails the test instead of stalling the suite
            call = asyncio.ensure_future(servicer.Session(None, context))  # type: ignore[arg-type]
            await settle()
            assert store.closed == [] and not call.done(), "a second message ended the session"
            context.incoming.put_nowait(grpc.aio.EOF)   # the client closes its side
            await call
        assert store.closed == ["s0"]
        assert [e.session_id for e in context.written] == ["s0"]

    asyncio.run(main())


def test_a_session_ends_with_a_closing_event_when_the_daemon_stops() -> None:
    async def main() -> None:
        store = SessionStore()
        stopping = asyncio.Event()
        servicer = KVStoreServicer(store, StubArena(), 30.0, 64, stopping)  # type: ignore[arg-type]
        context = SessionContext()
        context.incoming.put_nowait(pb.SessionRequest(client_name="engine", pid=1))
        async with asyncio.timeout(5):
            call = asyncio.ensure_future(servicer.Session(None, context))  # type: ignore[arg-type]
            await settle()
            stopping.set()
            await call
        assert store.closed == ["s0"]
        assert [e.closing for e in context.written] == [False, True]
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()] == []

    asyncio.run(main())


@pytest.mark.parametrize("ending", [StopAsyncIteration(), NotFound("no namespace of model 'm'")])
def test_a_progress_stream_cancelled_as_its_step_ends_leaves_no_unretrieved_error(ending: Exception) -> None:
    """Found by tests/integration/test_sdk_random.py (a client abandoning ``flushing``). Was: when
    the call was cancelled in the same turn as the progress step ended (a flush's last round, or
    its error), the step's exception was never retrieved and the daemon logged "Task exception
    was never retrieved" with a traceback, as if it had crashed."""
    from kvstored.server.servicer import _with_heartbeat

    async def main() -> None:
        last_round = asyncio.Event()

        async def progress() -> Any:
            yield 1
            await last_round.wait()
            if not isinstance(ending, StopAsyncIteration):
                raise ending

        stream = _with_heartbeat(progress(), lambda p: p)
        assert await anext(stream) == 1
        waiting = asyncio.ensure_future(anext(stream))
        for _ in range(5):
            await asyncio.sleep(0)
        last_round.set()   # the step ends ...
        waiting.cancel()   # ... as the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await stream.aclose()

    assert unretrieved_errors(main) == []


def test_a_load_stream_cancelled_as_its_load_fails_leaves_no_unretrieved_error() -> None:
    """Found by tests/integration/test_sdk_random.py (a client closed while its load_blocks
    stream started). Was: when the call was cancelled in the same turn as the load failed (its
    session closed meanwhile), the daemon logged "Task exception was never retrieved"."""
    failing = asyncio.Event()

    class Store:
        async def load_blocks(self, *args: Any, **kwargs: Any) -> Any:
            await failing.wait()
            raise FailedPrecondition("unknown session 's'")

    async def main() -> None:
        servicer = KVStoreServicer(Store(), None, 30.0, 64, asyncio.Event())  # type: ignore[arg-type]
        stream = servicer.LoadBlocksStream(pb.LoadBlocksRequest(session_id="s"), Context())  # type: ignore[arg-type]
        waiting = asyncio.ensure_future(anext(stream))
        for _ in range(5):
            await asyncio.sleep(0)
        failing.set()      # the load fails ...
        waiting.cancel()   # ... as the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await stream.aclose()
        for _ in range(5):
            await asyncio.sleep(0)

    assert unretrieved_errors(main) == []


def test_load_blocks_writes_no_engine_block_once_the_callers_deadline_has_passed(tmp_path: Any) -> None:
    """Found by tests/integration/test_cluster_random.py. Was: a daemon frozen (SIGSTOP) or starved
    between a LoadBlocks' lookup and its copy (here: a lookup that takes 0.3 s of a 0.1 s deadline)
    copied the blocks into the engine's buffers after the engine's call had failed with
    DeadlineExceeded and the engine could be reusing them. Now the copy does not start past the
    call's deadline: DEADLINE_EXCEEDED, the buffers untouched, nothing leased."""
    from kvstored import config
    from kvstored.buffers import TensorSource
    from kvstored.copy import CopyEngine
    from kvstored.store import BlockStore, KeyRequest
    from kvstored.tiers.dram import Arena
    from kvstored_client import shm
    from kvstored_client.contract.hashing import block_hashes
    from kvstored_client.contract.layout import TensorLayout
    from kvstored_client.contract.namespace import Namespace

    block = 4096

    class DeadlineContext(Context):
        def time_remaining(self) -> float:
            return 0.1

    cfg = config.build({"dram": {"capacity": 8 * block, "page_bytes": 4 * block, "prefault": False}})
    arena = Arena(str(tmp_path), cfg.dram.capacity, prefault=False)
    copy = CopyEngine(arena)
    store = BlockStore(cfg, arena, copy)
    engine = shm.empty((4, block), "uint8")
    try:
        session = store.open_session("engine", 1).session_id
        ns = store.open_namespace(Namespace(model="m", block_bytes=block)).namespace_id
        buffers = store.register_buffers(session, ns, [TensorSource(
            engine.name, 0, TensorLayout((4, block), (block, 1), "uint8", 0))])
        keys = block_hashes(list(range(32)))
        lookup = store.reads.lookup_chain

        async def slow_lookup(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.3)   # the daemon does not run meanwhile; the caller gives up
            return await lookup(*args, **kwargs)

        async def main() -> BaseException | None:
            engine.numpy()[:2] = 7
            await store.save_blocks(session, ns, buffers.buffers_id, KeyRequest(hashes=keys), [0, 1])
            engine.numpy()[:] = 0   # the engine's blocks, reused once the load failed
            store.reads.lookup_chain = slow_lookup   # type: ignore[method-assign]
            request = pb.LoadBlocksRequest(session_id=session, namespace_id=ns, buffers_id=buffers.buffers_id,
                                           block_ids=[2, 3])
            request.keys.hashes.extend(keys)
            servicer = KVStoreServicer(store, arena, 30.0, 64, asyncio.Event())
            try:
                await servicer.LoadBlocks(request, DeadlineContext())  # type: ignore[arg-type]
            except Aborted as exc:
                return exc
            return None

        exc = asyncio.run(main())
        assert not engine.numpy().any(), "the engine's blocks were written after the call's deadline"
        assert isinstance(exc, Aborted) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        assert store.stats().active_leases == 0
    finally:
        engine.close()
        copy.close()
        arena.close()
