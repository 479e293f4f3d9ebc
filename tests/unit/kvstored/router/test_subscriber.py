"""The subscriber against a scripted publisher (raw ZMQ sockets): a gap recovered by replay, a
replay that no longer reaches recovered by snapshot (nothing stale left), an engine stream
without replay followed best-effort, a silent node dropped."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio

from kvstored.events.wire import (
    END_OF_REPLAY,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    Event,
    decode_seq,
    encode_batch,
    encode_seq,
    make_seq,
)
from kvstored.router.index import GlobalIndex
from kvstored.router.subscriber import Source, Subscriber

EPOCH = 77


def stored(*hashes: int, medium: str = "CPU") -> BlockStored:
    return BlockStored(hashes, None, 16, medium, namespace_id=1)


class ScriptedPublisher:
    """Sends what the test says; answers replays from ``kept`` and snapshots with ``snapshot``."""

    def __init__(self, tmp: Path, epoch: int = EPOCH) -> None:
        self.epoch = epoch   # 0: a vLLM engine's stream (no epochs; seq from 0 at each start)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"ipc://{tmp}/pub")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{tmp}/replay")
        self.kept: list[tuple[int, bytes]] = []
        self.snapshot: tuple[int, list[Event]] | None = None
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, n: int, events: list[Event], keep: bool = True, deliver: bool = True) -> None:
        seq = make_seq(self.epoch, n)
        payload = encode_batch(Batch(time.time(), tuple(events)))
        if keep:
            self.kept.append((seq, payload))
        if deliver:
            self.pub.send_multipart([b"kv@a@m", encode_seq(seq), payload])

    def heartbeat(self, last: int) -> None:
        self.pub.send_multipart([b"kvstored-heartbeat@a", encode_seq(make_seq(EPOCH, last)),
                                 msgpack.packb([time.time(), [], None]), msgpack.packb({"node": "a"})])

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            *envelope, request = self.router.recv_multipart()
            self.requests.append(request)
            if request == SNAPSHOT_REQUEST and self.snapshot is not None:
                seq, events = self.snapshot
                self.router.send_multipart([*envelope, encode_seq(seq), encode_batch(Batch(0.0, tuple(events)))])
            elif request != SNAPSHOT_REQUEST:
                start = decode_seq(request)
                for seq, payload in self.kept:
                    if seq >= start:
                        self.router.send_multipart([*envelope, encode_seq(seq), payload])
            self.router.send_multipart([*envelope, encode_seq(END_OF_REPLAY), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


async def settle(predicate, timeout: float = 5.0) -> None:   # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def held(index: GlobalIndex, *hashes: int) -> list[int]:
    return index.rows(1, list(hashes))[1][:, 0].tolist() if index.nodes() else [0] * len(hashes)


def run(tmp: Path, script, replay: bool = True, heartbeats: bool = True,  # type: ignore[no-untyped-def]
        timeout_s: float = 5.0, epoch: int = EPOCH) -> None:
    publisher = ScriptedPublisher(tmp, epoch)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        index = GlobalIndex()
        source = Source("a", f"ipc://{tmp}/pub", f"ipc://{tmp}/replay" if replay else "", namespace_id=1,
                        heartbeats=heartbeats)
        sub = Subscriber(source, index, ctx, time.monotonic, timeout_s, request_timeout_s=2.0)
        sub.start()
        await asyncio.sleep(0.3)   # the SUB socket's connection (ZMQ's slow joiner)
        try:
            await script(publisher, sub, index)
        finally:
            await sub.close()
            ctx.term()
    try:
        asyncio.run(main())
    finally:
        publisher.close()


def test_a_gap_is_recovered_by_replay(tmp_path: Path) -> None:
    async def script(pub: ScriptedPublisher, sub: Subscriber, index: GlobalIndex) -> None:
        pub.send(0, [AllBlocksCleared()])
        pub.send(1, [stored(10, 11)])
        await settle(lambda: held(index, 10, 11) == [2, 2] and sub.up)
        assert sub.replays == 1   # the first contact: from the epoch's start
        pub.send(2, [stored(12)], deliver=False)          # lost on the way
        pub.send(3, [BlockRemoved((10,), "CPU", namespace_id=1)])
        await settle(lambda: held(index, 10, 11, 12) == [0, 2, 2])
        assert sub.stream.gaps == 1 and sub.replays == 2 and sub.snapshots == 0
        pub.send(4, [stored(13)], deliver=False)          # a lost tail: the heartbeat tells
        pub.heartbeat(4)
        await settle(lambda: held(index, 13) == [2])
        assert sub.stream.gaps == 2
    run(tmp_path, script)


def test_a_replay_that_no_longer_reaches_is_replaced_by_a_snapshot_with_nothing_stale(tmp_path: Path) -> None:
    async def script(pub: ScriptedPublisher, sub: Subscriber, index: GlobalIndex) -> None:
        pub.send(0, [AllBlocksCleared()])
        pub.send(1, [stored(10, 11, 12)])
        await settle(lambda: held(index, 10, 11, 12) == [2, 2, 2])
        pub.send(2, [BlockRemoved((11, 12), "CPU", namespace_id=1)], keep=False, deliver=False)
        pub.send(3, [stored(20)], keep=False, deliver=False)
        pub.kept.clear()                                  # the buffer moved past them
        pub.snapshot = (make_seq(EPOCH, 4), [AllBlocksCleared(), stored(10), stored(20, medium="DISK")])
        pub.send(5, [stored(30)])
        await settle(lambda: sub.snapshots == 1 and held(index, 30) == [2])
        assert held(index, 10, 11, 12, 20) == [2, 0, 0, 4]    # 11 and 12 are not left behind
        assert sub.stream.expected == make_seq(EPOCH, 6)
    run(tmp_path, script)


def test_an_engine_stream_without_replay_is_followed_best_effort(tmp_path: Path) -> None:
    async def script(pub: ScriptedPublisher, sub: Subscriber, index: GlobalIndex) -> None:
        pub.send(3, [stored(10, 11, medium="GPU")])
        await settle(lambda: held(index, 10, 11) == [1, 1])
        pub.send(4, [stored(12, medium="GPU")], deliver=False)
        pub.send(5, [stored(13, medium="GPU")])             # past a gap: what came before is unknown
        await settle(lambda: held(index, 13) == [1])
        assert held(index, 10, 11, 12) == [0, 0, 0]
        pub.send(6, [stored(14, medium="GPU")])
        await settle(lambda: held(index, 13, 14) == [1, 1])
        pub.send(0, [stored(15, medium="GPU")])             # the engine restarted (seq from 0)
        await settle(lambda: held(index, 13, 14, 15) == [0, 0, 1])
        await asyncio.sleep(0.5)
        assert sub.up                                       # no heartbeats expected: silence is fine
    run(tmp_path, script, replay=False, heartbeats=False, timeout_s=0.2, epoch=0)


def test_a_silent_node_is_dropped(tmp_path: Path) -> None:
    async def script(pub: ScriptedPublisher, sub: Subscriber, index: GlobalIndex) -> None:
        pub.send(0, [AllBlocksCleared(), stored(10)])
        await settle(lambda: held(index, 10) == [2])
        await settle(lambda: not sub.up, timeout=3.0)
        assert index.nodes() == []
        pub.heartbeat(0)                                     # back: rebuilt from the epoch's start
        await settle(lambda: sub.up and held(index, 10) == [2])
    run(tmp_path, script, timeout_s=0.5)
