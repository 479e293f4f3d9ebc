"""The publisher: KV event batches out of a ZMQ PUB socket, a replay and snapshot service on a
ROUTER socket, and a heartbeat, all on one sender thread so that the event loop never waits.

On the loop, :meth:`Publisher.publish` numbers a batch and queues it; a full queue drops it
(counted) and its number is never sent, which subscribers see as a gap. The sender thread
encodes each batch, sends it without blocking (a PUB socket past its high-water mark drops it,
counted too) and keeps the last ``buffer_steps`` for replay.

The replay socket answers, as vLLM's does, an 8-byte start seq with every kept batch from there
as ``[seq, payload]`` frames, then ``[-1, b""]``; and :data:`SNAPSHOT_REQUEST` with the store's
whole content as batches numbered with the seq they follow (the first clears everything), then
``[-1, b""]``. The heartbeat, every ``heartbeat_s`` on its own topic, is
``[topic, last seq, [ts, [], rank], info]``: the last seq numbered (sent or dropped), so an idle
subscriber learns of a lost tail or a restart (its epoch) within a heartbeat, and ``info`` a
msgpack map (``node``, ``epoch``, ``seq``, and what :meth:`set_info` put there).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from kvstored.events.wire import (
    END_OF_REPLAY,
    SNAPSHOT_REQUEST,
    Batch,
    Event,
    decode_seq,
    encode_batch,
    encode_seq,
    make_seq,
)

log = logging.getLogger("kvstored.events")

SNAPSHOT_TIMEOUT_S = 30.0
POLL_S = 0.05   # how long the sender waits for a batch before it looks at the replay socket again

# On the loop: [(namespace id or None, events)] and the seq the snapshot follows.
SnapshotSource = Callable[[], tuple[int, list[tuple[int | None, list[Event]]]]]


class Publisher:
    """Numbers and queues batches (on the loop), sends them (its thread). ``topic_of(namespace
    id or None)`` is the topic of a batch (None: a batch of every namespace)."""

    def __init__(self, endpoint: str, replay_endpoint: str, node_id: str, epoch: int,
                 topic_of: Callable[[int | None], str], heartbeat_topic: str, *, buffer_steps: int = 10000,
                 hwm: int = 100000, queue_batches: int = 10000, heartbeat_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self._topic_of = topic_of
        self._heartbeat_topic = heartbeat_topic.encode()
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._next = 0                  # batch number of the next batch (on the loop)
        self._lost_upto = -1            # last seq dropped before the sender saw it
        self._queue: queue.Queue[tuple[int, str, Batch]] = queue.Queue(queue_batches)
        self._replay: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._info: dict[str, Any] = {}
        self._snapshot: SnapshotSource | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sent_events = 0
        self.dropped_events = 0
        self.sent_batches = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot bind {endpoint if self._router is None else replay_endpoint}: {exc}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT) if self._router else ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop, snapshot: SnapshotSource | None = None) -> None:
        """Start sending; ``snapshot`` runs on ``loop`` when a subscriber asks for one."""
        self._loop, self._snapshot = loop, snapshot
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """The seq of the last batch numbered (-1: none yet)."""
        return make_seq(self.epoch, self._next - 1) if self._next else -1

    def set_info(self, **info: Any) -> None:
        """Add to what every heartbeat carries (msgpack-able values)."""
        self._info = {**self._info, **info}

    def publish(self, namespace_id: int | None, events: list[Event]) -> None:
        """Number and queue a batch (on the loop; never blocks)."""
        seq = make_seq(self.epoch, self._next)
        self._next += 1
        try:
            self._queue.put_nowait((seq, self._topic_of(namespace_id), Batch(self._clock(), tuple(events))))
        except queue.Full:
            self.dropped_events += len(events)
            self._lost_upto = seq

    # -- the sender thread --------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            if item is not None:
                self._send(*item)
                for _ in range(256):   # a burst, before looking at the replay socket
                    try:
                        self._send(*self._queue.get_nowait())
                    except queue.Empty:
                        break
            if self._router is not None:
                self._serve_requests()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self._heartbeat_s
                self._beat()

    def _send(self, seq: int, topic: str, batch: Batch) -> None:
        payload = encode_batch(batch)
        self._replay.append((seq, payload))
        try:
            self._pub.send_multipart([topic.encode(), encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_events += len(batch.events)
            return
        self.sent_events += len(batch.events)
        self.sent_batches += 1

    def _beat(self) -> None:
        seq = max(self._replay[-1][0] if self._replay else -1, self._lost_upto)
        info = {**self._info, "node": self.node_id, "epoch": self.epoch, "seq": seq}
        payload = msgpack.packb([self._clock(), [], None])
        try:
            self._pub.send_multipart([self._heartbeat_topic, encode_seq(seq), payload,
                                      msgpack.packb(info, use_bin_type=True)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _serve_requests(self) -> None:
        assert self._router is not None
        for _ in range(16):
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            # [identity, (b"" as vLLM's clients send), request]: replies keep the envelope
            envelope, request = frames[:-1], frames[-1]
            try:
                if request == SNAPSHOT_REQUEST:
                    self._send_snapshot(envelope)
                else:
                    self._send_replay(envelope, decode_seq(request))
            except (ValueError, zmq.ZMQError) as exc:
                log.debug("events: replay request refused: %s", exc)
                self._end_reply(envelope)

    def _send_replay(self, envelope: list[bytes], start: int) -> None:
        for seq, payload in list(self._replay):
            if seq >= start:
                self._router_send([*envelope, encode_seq(seq), payload])
        self._end_reply(envelope)

    def _send_snapshot(self, envelope: list[bytes]) -> None:
        if self._snapshot is None or self._loop is None:
            self._end_reply(envelope)
            return

        async def take() -> tuple[int, list[tuple[int | None, list[Event]]]]:
            assert self._snapshot is not None
            return self._snapshot()

        try:
            seq, batches = asyncio.run_coroutine_threadsafe(take(), self._loop).result(SNAPSHOT_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            log.warning("events: snapshot failed: %s", exc or type(exc).__name__)
            self._end_reply(envelope)
            return
        ts = self._clock()
        for _namespace_id, events in batches:
            self._router_send([*envelope, encode_seq(seq), encode_batch(Batch(ts, tuple(events)))])
        self._end_reply(envelope)

    def _router_send(self, frames: list[bytes]) -> None:
        assert self._router is not None
        self._router.send_multipart(frames)

    def _end_reply(self, envelope: list[bytes]) -> None:
        self._router_send([*envelope, encode_seq(END_OF_REPLAY), b""])

    def close(self) -> None:
        """Stop the thread (batches still queued are dropped) and close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
