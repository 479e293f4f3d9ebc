"""Simulated nodes: each one's cache run by the store's real policies over a real prefix index,
an engine model with the cost model's prefill and decode times and a FIFO queue, and the KV
events it publishes (delivered to the router's index when the prefill that stored the blocks
is done, as a real engine's events come after its compute).

A request's hits are taken when it is routed (blocks of requests queued ahead on the same node
count: they will be there by its turn), so its TTFT is known exactly at that moment:
``wait for the node + max(prefill of the uncached suffix, fetch of the hits) + first-block decode``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstored.events.wire import BlockRemoved, BlockStored, Event
from kvstored.index import SEALED, Block, PrefixIndex
from kvstored.policy.cost import ModelShape, prefix_prefill_flops
from kvstored.policy.registry import make_policy


@dataclass(frozen=True, slots=True)
class Req:
    arrival: float
    tokens: int
    output: int
    chain: tuple[int, ...]   # full blocks' ids, root first


@dataclass(frozen=True, slots=True)
class EngineModel:
    """The true speeds of every simulated engine (the router only learns them from reports)."""

    shape: ModelShape
    block_tokens: int
    block_bytes: int
    flops_per_s: float = 3.0e14
    overhead_s: float = 0.01
    decode_s: float = 0.02
    dram_bytes_per_s: float = 19e9
    peer_bytes_per_s: float = 5e9
    tpot_s: float = 0.03   # per output token, for the decode phase's load signal

    def prefill_s(self, tokens: int, cached_blocks: int) -> float:
        cached = min(cached_blocks * self.block_tokens, tokens - 1)
        flops = prefix_prefill_flops(self.shape, tokens, 1) - prefix_prefill_flops(self.shape, cached, 1)
        return self.overhead_s + flops / self.flops_per_s

    def service_s(self, tokens: int, local: int, pulled: int) -> float:
        """Prefill of what is not cached, overlapped with bringing ``local`` blocks from DRAM and
        ``pulled`` more over the peer link; then the first-block decode."""
        fetch = max(local * self.block_bytes / self.dram_bytes_per_s, pulled * self.block_bytes / self.peer_bytes_per_s)
        return max(self.prefill_s(tokens, local + pulled), fetch) + self.decode_s


class NodeCache:
    """One node's cache: a prefix index of ``capacity`` blocks under a real eviction policy."""

    def __init__(self, capacity: int, policy: str, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.index = PrefixIndex(1)
        self.policy = make_policy(policy, clock, capacity)

    @staticmethod
    def key(block_id: int) -> bytes:
        return block_id.to_bytes(8, "big")

    def match(self, chain: tuple[int, ...]) -> int:
        return len(self.index.match([self.key(b) for b in chain]))

    def admit(self, chain: tuple[int, ...]) -> tuple[int, list[int], list[int]]:
        """Look ``chain`` up (a hit for the policy) and store what is missing, evicting what the
        policy picks; returns (hits, stored ids, evicted ids)."""
        keys = [self.key(b) for b in chain]
        hits = self.index.match(keys)
        if hits:
            self.policy.hit(hits)
        for block in hits:
            block.pins += 1
        parent: Block | None = hits[-1] if hits else None
        new: list[Block] = []
        evicted: list[int] = []
        for key in keys[len(hits):]:
            if not self.policy.admit(key, len(self.index) >= self.capacity):
                break
            while len(self.index) >= self.capacity:
                victim = self.policy.victim()
                if victim is None:
                    break
                self.index.remove(victim)
                self.policy.removed(victim)
                evicted.append(int.from_bytes(victim.key, "big"))
            if len(self.index) >= self.capacity:
                break
            parent = self.index.insert(key, parent, 0)
            new.append(parent)
        for block in new:
            block.flags |= SEALED
            block.pins -= 1
        if new:
            self.policy.inserted(new)
        for block in hits:
            block.pins -= 1
        return len(hits), [int.from_bytes(b.key, "big") for b in new], evicted


@dataclass
class SimNode:
    name: str
    cache: NodeCache
    busy_until: float = 0.0
    work_s: float = 0.0
    waiting: list[float] = field(default_factory=list)    # heap of prefill ends of requests routed here
    active: list[float] = field(default_factory=list)     # heap of request ends (decode done)

    def backlog_s(self, now: float) -> float:
        return max(0.0, self.busy_until - now)

    def settle(self, now: float) -> None:
        while self.waiting and self.waiting[0] <= now:
            heapq.heappop(self.waiting)
        while self.active and self.active[0] <= now:
            heapq.heappop(self.active)


@dataclass(frozen=True, slots=True)
class Served:
    node: int
    ttft_s: float
    hit_blocks: int
    pulled_blocks: int
    prefill_end: float
    end: float


class Cluster:
    """K simulated nodes; ``serve`` runs a request on the node chosen and returns its outcome;
    events and completions come out of ``due(now)`` in time order."""

    def __init__(self, k: int, capacity: int, policy: str, engine: EngineModel, namespace_id: int) -> None:
        self.now = 0.0
        self.namespace_id = namespace_id
        self.engine = engine
        self.nodes = [SimNode(f"node-{i}", NodeCache(capacity, policy, lambda: self.now)) for i in range(k)]
        self._due: list[tuple[float, int, str, object]] = []   # (time, order, kind, payload)
        self._order = 0

    def _at(self, time: float, kind: str, payload: object) -> None:
        self._order += 1
        heapq.heappush(self._due, (time, self._order, kind, payload))

    def due(self, now: float) -> list[tuple[str, object]]:
        """What happened up to ``now``: ("events", (node, [events])) and ("prefill", (node, req, hits, seconds))."""
        out = []
        while self._due and self._due[0][0] <= now:
            _, _, kind, payload = heapq.heappop(self._due)
            out.append((kind, payload))
        return out

    def exact_ttft(self, i: int, req: Req, now: float, donor: int | None = None) -> tuple[float, int, int]:
        """(TTFT, local hits, pulled) of ``req`` on node ``i`` now, pulling from ``donor``'s
        longer prefix when that is quicker."""
        node = self.nodes[i]
        local = node.cache.match(req.chain)
        wait = node.backlog_s(now)
        best = (wait + self.engine.service_s(req.tokens, local, 0), local, 0)
        if donor is not None and donor != i:
            extra = self.nodes[donor].cache.match(req.chain) - local
            if extra > 0:
                t = wait + self.engine.service_s(req.tokens, local, extra)
                if t < best[0]:
                    best = (t, local, extra)
        return best

    def serve(self, i: int, req: Req, now: float, pull_from: int | None = None) -> Served:
        node = self.nodes[i]
        node.settle(now)
        local = node.cache.match(req.chain)
        pulled = 0
        if pull_from is not None and pull_from != i:
            pulled = max(0, self.nodes[pull_from].cache.match(req.chain) - local)
        hits, stored, evicted = node.cache.admit(req.chain)
        assert hits == local
        service = self.engine.service_s(req.tokens, local, pulled)
        start = max(now, node.busy_until)
        prefill_end = start + service
        node.busy_until = prefill_end
        node.work_s += service
        end = prefill_end + req.output * self.engine.tpot_s
        heapq.heappush(node.waiting, prefill_end)
        heapq.heappush(node.active, end)
        events: list[Event] = []
        if evicted:
            events.append(BlockRemoved(tuple(evicted), "GPU", namespace_id=self.namespace_id))
        if stored:
            events.append(BlockStored(tuple(stored), None, self.engine.block_tokens, "GPU",
                                      namespace_id=self.namespace_id))
        if events:
            self._at(prefill_end, "events", (i, events))
        prefill = self.engine.prefill_s(req.tokens, local + pulled)
        self._at(prefill_end, "prefill", (i, req, local + pulled, prefill))
        return Served(i, prefill_end - now, local, pulled, prefill_end, end)
