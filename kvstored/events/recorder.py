"""The recorder: the store's tier events (:class:`kvstored.store.events.TierEvents`) turned into
KV events, gathered per namespace over one turn of the event loop and handed on as batches.

It runs on the event loop, in the store's calls: it only reads the blocks' keys and parents and
appends to a list; encoding and sending are the publisher's, on its own thread. A chain of
blocks stored together is one ``BlockStored`` (a run of blocks each the parent of the next).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstored.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, HashFormat, Medium, wire_hash
from kvstored.index import Block, PrefixIndex, Tier

MEDIUM = {Tier.DRAM: Medium.CPU.value, Tier.SSD: Medium.DISK.value}
MAX_EVENTS_PER_BATCH = 1024


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """What events say of a namespace: its model (the topic) and tokens per block."""

    model: str
    block_size: int


# (namespace id or None for a batch of every namespace, events) -> None; on the event loop
Sink = Callable[[int | None, list[Event]], None]


class EventRecorder:
    """Implements ``TierEvents``. ``namespaces(id)`` describes a namespace (None: unknown, its
    events are dropped); ``schedule(fn)`` runs ``fn`` once the current loop turn is over
    (``loop.call_soon``), where the gathered events go to ``sink``."""

    def __init__(self, sink: Sink, namespaces: Callable[[int], NamespaceInfo | None],
                 schedule: Callable[[Callable[[], None]], object], fmt: HashFormat = HashFormat.INT64) -> None:
        self._sink = sink
        self._namespaces = namespaces
        self._schedule = schedule
        self._fmt = fmt
        self._pending: dict[int, list[Event]] = {}
        self._scheduled = False

    def _add(self, namespace_id: int, event: Event) -> None:
        self._pending.setdefault(namespace_id, []).append(event)
        if not self._scheduled:
            self._scheduled = True
            self._schedule(self.flush)

    def stored(self, blocks: Sequence[Block], tier: Tier) -> None:
        medium = MEDIUM[tier]
        run: list[Block] = []
        for block in blocks:
            if run and (block.parent is not run[-1] or block.index is not run[0].index):
                self._store_run(run, medium)
                run = []
            run.append(block)
            if len(run) == MAX_EVENTS_PER_BATCH:
                self._store_run(run, medium)
                run = []
        if run:
            self._store_run(run, medium)

    def _store_run(self, run: list[Block], medium: str) -> None:
        index = run[0].index
        info = self._namespaces(index.namespace_id)
        if info is None:
            return
        parent = run[0].parent
        self._add(index.namespace_id, BlockStored(
            tuple(wire_hash(b.key, self._fmt) for b in run),
            None if parent is None else wire_hash(parent.key, self._fmt), info.block_size, medium,
            namespace_id=index.namespace_id))

    def removed(self, blocks: Sequence[Block], tier: Tier) -> None:
        medium = MEDIUM[tier]
        by_namespace: dict[int, list[int | bytes]] = {}
        for block in blocks:
            by_namespace.setdefault(block.index.namespace_id, []).append(wire_hash(block.key, self._fmt))
        for namespace_id, hashes in by_namespace.items():
            self._add(namespace_id, BlockRemoved(tuple(hashes), medium, namespace_id=namespace_id))

    def cleared(self) -> None:
        self.flush()
        self._sink(None, [AllBlocksCleared()])

    def flush(self) -> None:
        """Hand the gathered events on now, a batch of at most MAX_EVENTS_PER_BATCH per namespace."""
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for namespace_id, events in pending.items():
            for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
                self._sink(namespace_id, events[i:i + MAX_EVENTS_PER_BATCH])

    def snapshot(self, indexes: Iterable[PrefixIndex]) -> list[tuple[int | None, list[Event]]]:
        """Events that rebuild every readable block's tiers from nothing: ``AllBlocksCleared``, then
        each namespace's chains, a ``BlockStored`` per run of blocks in the same tier. Pending
        events are handed on first, so the snapshot follows every batch numbered before it."""
        self.flush()
        out: list[tuple[int | None, list[Event]]] = [(None, [AllBlocksCleared()])]
        for index in indexes:
            info = self._namespaces(index.namespace_id)
            if info is None:
                continue
            events: list[Event] = []
            for _parent, keys in index.chains():
                blocks = [b for k in keys if (b := index.get(k)) is not None]
                for tier, has in ((Tier.DRAM, lambda b: b.in_dram), (Tier.SSD, lambda b: b.on_ssd)):
                    run: list[Block] = []
                    for block in blocks:
                        if has(block):
                            run.append(block)
                        elif run:
                            events.append(self._stored_event(run, info, tier))
                            run = []
                    if run:
                        events.append(self._stored_event(run, info, tier))
            for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
                out.append((index.namespace_id, events[i:i + MAX_EVENTS_PER_BATCH]))
        return out

    def _stored_event(self, run: list[Block], info: NamespaceInfo, tier: Tier) -> BlockStored:
        parent = run[0].parent
        return BlockStored(tuple(wire_hash(b.key, self._fmt) for b in run),
                           None if parent is None else wire_hash(parent.key, self._fmt), info.block_size,
                           MEDIUM[tier], namespace_id=run[0].index.namespace_id)
