"""The daemon's KV events switched on (``[events]``): the store's observer and the publisher,
connected, with the heartbeat's report of this node's namespaces and tier costs kept fresh."""

from __future__ import annotations

import asyncio
import secrets
import socket

from kvstored.config import Config
from kvstored.events.publisher import Publisher
from kvstored.events.recorder import EventRecorder, NamespaceInfo
from kvstored.events.wire import EPOCH_BITS, Event, HashFormat
from kvstored.policy.cost import DRAM_REFERENCE, SSD_REFERENCE
from kvstored.store import BlockStore


def node_id(cfg: Config) -> str:
    return cfg.events.node_id or cfg.peers.node_id or socket.gethostname()


def new_epoch() -> int:
    """A number for this run of the daemon, different from the last run's but by chance
    (1 in 8 million): nothing is kept between runs."""
    return 1 + secrets.randbelow((1 << EPOCH_BITS) - 1)


class KvEvents:
    """The recorder observing ``store`` and the publisher sending what it records."""

    def __init__(self, cfg: Config, store: BlockStore, loop: asyncio.AbstractEventLoop, epoch: int | None = None):
        e = cfg.events
        node = node_id(cfg)
        self._store = store
        catalog = store.catalog

        def describe(namespace_id: int) -> NamespaceInfo | None:
            state = catalog.find(namespace_id)
            return None if state is None else NamespaceInfo(state.spec.model, state.spec.block_size)

        def topic_of(namespace_id: int | None) -> str:
            info = None if namespace_id is None else describe(namespace_id)
            return e.topic.format(node=node, model=info.model if info is not None else "*")

        self.publisher = Publisher(e.endpoint, e.replay_endpoint, node, new_epoch() if epoch is None else epoch,
                                   topic_of, e.heartbeat_topic.format(node=node), buffer_steps=e.buffer_steps,
                                   hwm=e.hwm, queue_batches=e.queue_batches, heartbeat_s=e.heartbeat_s)
        self.recorder = EventRecorder(self.publisher.publish, describe, loop.call_soon, HashFormat(e.hash_format))
        self._loop = loop
        self._interval = e.heartbeat_s
        tiers = {"CPU": DRAM_REFERENCE} | ({"DISK": SSD_REFERENCE} if cfg.ssd.enabled else {})
        self.publisher.set_info(tiers={name: {"read_bytes_per_s": t.read_bytes_per_s,
                                              "read_latency_s": t.read_latency_s} for name, t in tiers.items()})

    def start(self) -> None:
        """Announce a clean slate (this epoch starts empty), observe the store, start sending."""
        self.recorder.cleared()
        self._store.observe(self.recorder)
        self.publisher.start(self._loop, self._snapshot)

    def _snapshot(self) -> tuple[int, list[tuple[int | None, list[Event]]]]:
        batches = self.recorder.snapshot(state.index for state in self._store.catalog)
        return self.publisher.last_seq, batches

    async def report_loop(self) -> None:
        """Keep the namespaces the heartbeat reports (model, tokens and bytes per block) fresh."""
        while True:
            self.publisher.set_info(namespaces={
                state.namespace_id: {"model": state.spec.model, "block_size": state.spec.block_size,
                                     "block_bytes": state.spec.block_bytes}
                for state in self._store.catalog})
            await asyncio.sleep(self._interval)

    def close(self) -> None:
        self.publisher.close()
