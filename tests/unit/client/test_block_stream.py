"""BlockStream (``Client.stream``) against a scripted call and arena: what it copies when."""

from __future__ import annotations


def test_an_arena_stream_hands_over_block_0_without_first_copying_the_whole_event() -> None:
    """client.stream() without buffers: the daemon sends a whole cached prefix in its first event.
    BlockStream copied every block of an event out of the arena before yielding the first
    (client.py __iter__: ``arrivals = [...]; yield from arrivals``): for a 1,000-block prefix of
    2 MiB blocks that is 2 GiB copied and held before block 0 reaches the engine, although the
    stream exists to start on block 0 at once, and a loop well inside the lease needs no eager
    copy (every copy before started + ttl/2 is under the lease; later ones are checked by the
    final Release)."""
    import time
    from types import SimpleNamespace

    import numpy as np

    from kvstored_client.contract.proto import kvstored_pb2 as pb
    from kvstored_client.streams import BlockStream

    n, size = 64, 256
    backing = np.arange(n * size, dtype=np.uint32).astype(np.uint8)
    copies: list[int] = []

    class CountingArena:
        def __getitem__(self, s):  # type: ignore[no-untyped-def]
            view = backing[s]
            return SimpleNamespace(copy=lambda: (copies.append(s.start), view.copy())[1])

    class Call(list):  # type: ignore[type-arg]
        def cancel(self) -> None:
            pass

    first = pb.BlockEvent(lease_id=7)
    for i in range(n):
        first.blocks.add(index=i, tier=pb.TIER_DRAM, offset=i * size)
    end = pb.BlockEvent()
    end.end.CopyFrom(pb.BlockStreamEnd(blocks=n, requested=n, stop="complete", lease_id=7, lease_ttl_ms=30_000))
    released: list[int] = []
    client = SimpleNamespace(_hello=SimpleNamespace(lease_ttl_ms=30_000),
                             _release_later=lambda s, lease: released.append(lease))
    stream = BlockStream(client, "s", Call([first, end]), CountingArena(), 16, size,  # type: ignore[arg-type]
                         time.monotonic())
    it = iter(stream)
    arrival = next(it)
    assert arrival.index == 0 and bytes(arrival.data) == bytes(backing[:size])
    assert len(copies) == 1, f"{len(copies)} blocks were copied before block 0 was handed over"
    rest = list(it)
    assert len(rest) == n - 1 and released == [7]


def test_a_stream_cancelled_by_anyone_but_its_caller_raises() -> None:
    """Was: any CANCELLED status ended the loop quietly with ``outcome`` None, as the caller's
    own close() does: a client closed by another thread, or a stopping daemon, looked like a
    stream the caller had stopped itself."""
    import time
    from types import SimpleNamespace

    import grpc
    import pytest

    import kvstored
    from kvstored_client.streams import BlockStream

    class Cancelled(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.CANCELLED

        def details(self) -> str:
            return "CANCELLED"

    class Call:
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise Cancelled()
            yield

        def cancel(self) -> None:
            pass

    client = SimpleNamespace(_hello=SimpleNamespace(lease_ttl_ms=30_000),
                             _error=lambda exc: kvstored.DaemonNotRunning("went away"))
    stream = BlockStream(client, "s", Call(), None, 16, 256, time.monotonic())  # type: ignore[arg-type]
    with pytest.raises(kvstored.DaemonNotRunning):
        list(stream)
    closed = BlockStream(client, "s", Call(), None, 16, 256, time.monotonic())  # type: ignore[arg-type]
    closed.close()
    assert list(closed) == [] and closed.outcome is None   # the caller's own close: a quiet end
