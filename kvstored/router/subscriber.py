"""The subscriber: one node's KV event stream followed into the global index, over ZMQ.

It reads the node's PUB socket, asks the stream tracker what each frame means and acts: applies
a batch, rebuilds the node from the start of its epoch (a replay from batch 0, else a snapshot)
when the node is new to it or restarted, replays from the first batch missed after a gap (a
snapshot when the replay no longer reaches it), and drops the node from the index at once when
it has been silent past the timeout. Heartbeats' info maps go to ``on_info``.

A source that cannot be rebuilt (no replay socket, or an engine's, which serves no snapshot, when
its replay does not reach back far enough) is followed best-effort: a gap or a restart clears it
and it is learned anew from the batch that showed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvstored.events.wire import (
    END_OF_REPLAY,
    SNAPSHOT_REQUEST,
    Event,
    WireError,
    decode_batch,
    decode_seq,
    encode_seq,
)
from kvstored.router.index import GlobalIndex
from kvstored.router.stream import Action, NodeStream

log = logging.getLogger("kvstored.router")
MAX_BURST = 64   # frames read before their batches are applied


@dataclass(frozen=True, slots=True)
class Source:
    """Where one node's events come from. ``namespace_id``: for events that name none (a vLLM
    engine's, whose namespace the router's config gives); ``heartbeats``: whether the publisher
    sends them (kvstored does; vLLM does not, so its silence is not death)."""

    node: str
    endpoint: str
    replay_endpoint: str = ""
    namespace_id: int = 0
    heartbeats: bool = True
    stream: str = ""   # a second stream of the node (its engine's: "gpu"), indexed apart

    @property
    def name(self) -> str:
        """The source's name in the index: the node id, or ``node/stream``."""
        return f"{self.node}/{self.stream}" if self.stream else self.node


class Subscriber:
    """Follows ``source`` into ``index`` until :meth:`close`. ``up``: in sync and not silent."""

    def __init__(self, source: Source, index: GlobalIndex, ctx: zmq.asyncio.Context, clock: Callable[[], float],
                 timeout_s: float, on_info: Callable[[str, dict[str, Any]], None] | None = None,
                 request_timeout_s: float = 10.0) -> None:
        self.source = source
        self._index = index
        self._ctx = ctx
        self._timeout = timeout_s
        self._request_timeout = request_timeout_s
        self._on_info = on_info
        self.stream = NodeStream(clock, timeout_s)
        self.up = False
        self.snapshots = 0
        self.replays = 0
        self.bad_frames = 0
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 1_000_000)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(source.endpoint)
        self._task: asyncio.Task[None] | None = None
        self._pending: list[Event] = []   # batches received in a burst, applied at its end

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sub.close(0)

    def drop(self, why: str) -> None:
        """Forget the node (silent, or its membership ended); its next frame resyncs it."""
        self._pending = []
        if self.up or self.source.name in self._index.sources():
            log.info("router: dropping node %s: %s", self.source.node, why)
        self._index.drop(self.source.name)
        self.stream.lost()
        self.up = False

    async def run(self) -> None:
        poll_ms = int(max(self._timeout / 4, 0.05) * 1000)
        while True:
            if not await self._sub.poll(poll_ms):
                if self.source.heartbeats and self.stream.silent() and (self.up or self.stream.in_sync):
                    self.drop(f"no event or heartbeat for {self._timeout:g} s")
                continue
            # the frames already here, up to a bound: their batches are applied together (the
            # index's fixed cost per apply is paid once per burst, not per batch)
            for _ in range(MAX_BURST):
                frames = await self._sub.recv_multipart()
                try:
                    await self._frame(frames)
                except WireError as exc:
                    self.bad_frames += 1
                    log.warning("router: bad frame from %s: %s", self.source.node, exc)
                if not await self._sub.poll(0):
                    break
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._index.apply(self.source.name, pending, self.source.namespace_id)

    async def _frame(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            raise WireError(f"expected [topic, seq, payload], got {len(frames)} frames")
        seq = decode_seq(frames[1])
        if len(frames) >= 4:   # a heartbeat: [topic, last seq, empty batch, info]
            with contextlib.suppress(ValueError, TypeError, msgpack.ExtraData):
                info = msgpack.unpackb(frames[3], strict_map_key=False)
                if isinstance(info, dict) and self._on_info is not None:
                    self._on_info(self.source.node, info)
            action = self.stream.heartbeat(seq)
        else:
            action = self.stream.batch(seq)
        if action is Action.APPLY:
            self._pending.extend(decode_batch(frames[2]).events)
            self.up = True
            return
        self._flush()
        if action is Action.RECOVER:
            assert self.stream.expected is not None
            await self._rebuild(self.stream.expected, clear=False)
        elif action is Action.RESYNC:
            if not self.source.heartbeats and self.stream.resyncs > 1:
                log.info("router: %s restarted or rewound its stream: clearing it", self.source.node)
            await self._rebuild(self.stream.epoch_start(), clear=True)
        else:
            return
        if len(frames) != 3:
            return
        # the batch that showed the gap: applied now if the rebuild stopped short of it
        if self.stream.in_sync:
            if self.stream.batch(seq) is Action.APPLY:
                self._index.apply(self.source.name, decode_batch(frames[2]).events, self.source.namespace_id)
        elif not self.source.replay_endpoint or not self.source.heartbeats:
            # best effort (no replay, or an engine's, which has no snapshot): what came before is unknown
            self._index.clear(self.source.name)
            self._index.apply(self.source.name, decode_batch(frames[2]).events, self.source.namespace_id)
            self.stream.synced(seq + 1)
            self.up = True

    async def _rebuild(self, start: int, clear: bool) -> None:
        """Bring the node's entries up to date from ``start``: a replay when it reaches, else a
        snapshot; failing both, the node is dropped until its next frame."""
        replay = await self._ask(encode_seq(start)) if self.source.replay_endpoint else None
        if replay and replay[0][0] == start and all(b[0] == a[0] + 1 for a, b in itertools.pairwise(replay)):
            self.replays += 1
            if clear:
                self._index.clear(self.source.name)
            self._index.apply(self.source.name, [e for _seq, payload in replay for e in decode_batch(payload).events],
                              self.source.namespace_id)
            self.stream.synced(replay[-1][0] + 1)
            self.up = True
            return
        snapshot = await self._ask(SNAPSHOT_REQUEST) if self.source.replay_endpoint else None
        if snapshot:
            self.snapshots += 1
            self._index.clear(self.source.name)
            self._index.apply(self.source.name,
                              [e for _seq, payload in snapshot for e in decode_batch(payload).events],
                              self.source.namespace_id)
            self.stream.synced(snapshot[0][0] + 1)
            self.up = True
            return
        self._index.clear(self.source.name)
        self.stream.lost()
        self.up = False

    async def _ask(self, request: bytes) -> list[tuple[int, bytes]] | None:
        """The replay socket's answer to ``request`` (batches until the end marker), or None
        when it does not answer in time."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", request])
            while True:
                if not await dealer.poll(int(self._request_timeout * 1000)):
                    log.warning("router: %s's replay socket did not answer in %g s", self.source.node,
                                self._request_timeout)
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) < 2:
                    continue
                seq = decode_seq(frames[-2])
                if seq == END_OF_REPLAY:
                    return out
                out.append((seq, frames[-1]))
        finally:
            dealer.close(0)
