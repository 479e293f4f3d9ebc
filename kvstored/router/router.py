"""The router: a request's chain looked up in the global index, each available node priced by
the TTFT ledger (:mod:`kvstored.policy.routing`) with its queue, fitted prefill speed and tier
speeds, and one chosen. The answer names the node and every candidate's breakdown.

Expected failures raise :class:`RouteError` with a reason (``invalid_argument``,
``no_candidate``) and change nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstored.policy.cost import ModelShape, shape_for
from kvstored.policy.routing import Breakdown, Held, NodeCosts, Request, choose, estimate_all
from kvstored.router.calibration import Calibration
from kvstored.router.index import GlobalIndex, hashes64, namespace_mix
from kvstored.router.load import LoadBoard
from kvstored.router.pending import PendingChains
from kvstored.router.reports import NodeReports
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace

MAX_BLOCKS = 1 << 18


def index_keys_of(namespace_id: int, keys: np.ndarray) -> np.ndarray:
    return keys ^ np.uint64(namespace_mix(namespace_id))


class RouteError(ValueError):
    """A route request that cannot be answered; ``reason`` says which kind of failure."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """A prompt as token ids, or as its chain of block hashes (ints or 32-byte keys) with its
    length in tokens (default: whole blocks). ``candidates``: only these nodes (default: all up)."""

    namespace: Namespace
    token_ids: Sequence[int] = ()
    block_hashes: Sequence[int | bytes] = ()
    tokens: int = 0
    candidates: Sequence[str] = ()
    cache_salt: str = ""
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    node: str
    namespace_id: int
    blocks: int
    tokens: int
    candidates: tuple[Breakdown, ...]


@dataclass(frozen=True, slots=True)
class Defaults:
    """Figures a node has not reported: the prior prefill speed, the decode time of a first
    block, link and tier speeds (the reference machine's), and how near-equal spreads."""

    costs: NodeCosts = field(default_factory=lambda: NodeCosts(queue_s=0.0, prefill_flops_per_s=4e14, decode_s=0.02))
    spread: float = 0.05
    spread_s: float = 1e-3


class Router:
    """``available()``: the nodes that may be chosen now (in sync, alive, members)."""

    def __init__(self, index: GlobalIndex, load: LoadBoard, calibration: Calibration, reports: NodeReports,
                 available: Callable[[], Iterable[str]], rng: random.Random | None = None,
                 defaults: Defaults | None = None, shapes: Callable[[str], ModelShape] = shape_for) -> None:
        self.index = index
        self.load = load
        self.calibration = calibration
        self.reports = reports
        self._available = available
        self._rng = rng or random.Random()
        self._defaults = defaults or Defaults()
        self._shapes = shapes
        self.pending = PendingChains(load.clock)
        self.routed = 0

    def chain(self, query: RouteQuery) -> tuple[int, np.ndarray, int]:
        """The namespace id, the chain's 64-bit hashes and the prompt's length in tokens."""
        ns = query.namespace
        try:
            ns.validate()
        except ValueError as exc:
            raise RouteError("invalid_argument", str(exc)) from None
        if (query.token_ids and query.block_hashes) or not (query.token_ids or query.block_hashes or query.tokens):
            raise RouteError("invalid_argument", "give token_ids or block_hashes (one of them)")
        if not query.token_ids:   # hashes; none at all for a prompt shorter than a block
            if len(query.block_hashes) > MAX_BLOCKS:
                raise RouteError("invalid_argument", f"{len(query.block_hashes)} blocks exceed {MAX_BLOCKS}")
            try:
                keys = hashes64(query.block_hashes)
            except (TypeError, OverflowError, ValueError):
                raise RouteError("invalid_argument", "block_hashes must be ints or byte strings") from None
            tokens = query.tokens or len(keys) * ns.block_size
            if tokens < len(keys) * ns.block_size:
                raise RouteError("invalid_argument", f"tokens {tokens} is shorter than {len(keys)} whole blocks")
            return ns.identity(), keys, tokens
        if len(query.token_ids) > MAX_BLOCKS * ns.block_size:
            raise RouteError("invalid_argument", f"{len(query.token_ids)} tokens exceed {MAX_BLOCKS} blocks")
        try:
            hashes = block_hashes(query.token_ids, ns.block_size, ns.hash_seed, ns.hash_algo,
                                  cache_salt=query.cache_salt or None, lora_name=query.lora_name or None)
        except (ValueError, TypeError) as exc:
            raise RouteError("invalid_argument", f"token_ids: {exc}") from None
        keys = hashes64(hashes)
        return ns.identity(), keys, len(query.token_ids)

    def costs(self, node: str) -> NodeCosts:
        """What ``node``'s TTFT is priced with now."""
        speed = self.calibration.speed(node)
        base = self._defaults.costs
        dram = self.reports.tier(node, "CPU")
        ssd = self.reports.tier(node, "DISK")
        return NodeCosts(self.load.queue_s(node), speed.flops_per_s,
                         speed.overhead_s if speed.samples else base.prefill_overhead_s,
                         dram.read_bytes_per_s if dram else base.dram_bytes_per_s,
                         ssd.read_bytes_per_s if ssd else base.ssd_bytes_per_s,
                         ssd.read_latency_s if ssd else base.ssd_latency_s, base.peer_bytes_per_s, base.decode_s)

    def estimate(self, query: RouteQuery) -> tuple[int, int, int, list[Breakdown]]:
        """Every candidate's breakdown (sorted by node), without choosing."""
        namespace_id, keys, tokens, breakdowns = self._estimate(query)
        return namespace_id, len(keys), tokens, breakdowns

    def _estimate(self, query: RouteQuery) -> tuple[int, np.ndarray, int, list[Breakdown]]:
        namespace_id, keys, tokens = self.chain(query)
        up = set(self._available())
        if query.candidates:
            unknown = sorted(set(query.candidates) - up)
            if unknown and len(unknown) == len(set(query.candidates)):
                raise RouteError("no_candidate", f"none of the candidates is available: {', '.join(unknown)}")
            up &= set(query.candidates)
        if not up:
            raise RouteError("no_candidate", "no node is available (none in sync with its events, or all down)")
        holdings = self.index.holdings(namespace_id, keys)
        held = {node: Held(int(p), int(g), int(d), int(s)) for node, p, g, d, s in
                zip(holdings.nodes, holdings.prefix, holdings.gpu, holdings.dram, holdings.ssd) if node in up}
        donors = dict(held)   # only blocks there now can be pulled
        table_keys = index_keys_of(namespace_id, keys)
        for node in up:   # what this router sent there that the node's events do not show yet
            h = held.get(node, Held(0))
            sent = self.pending.prefix(node, table_keys) if h.prefix < len(keys) else 0
            if sent > h.prefix:
                held[node] = Held(sent, h.gpu, h.dram + sent - h.prefix, h.ssd)
        ns = query.namespace
        shape = self._shapes(ns.model)
        nbytes = self.reports.block_bytes(namespace_id) or ns.block_bytes or \
            shape.kv_bytes_per_token() * ns.block_size // max(ns.tp_size, 1)
        request = Request(tokens, ns.block_size, nbytes)
        return namespace_id, keys, tokens, estimate_all(request, shape, held, {node: self.costs(node) for node in up},
                                                        donors)

    def route(self, query: RouteQuery, record: bool = True) -> RouteAnswer:
        """Choose a node; with ``record`` its predicted prefill joins its queue here."""
        namespace_id, keys, tokens, breakdowns = self._estimate(query)
        chosen = choose(breakdowns, self._rng, self._defaults.spread, self._defaults.spread_s)
        if record:
            self.load.routed(chosen.node, chosen.prefill_s)
            self.pending.sent(chosen.node, index_keys_of(namespace_id, keys), chosen.queue_s + chosen.prefill_s)
            self.routed += 1
            if self.routed % 1024 == 0:
                self.pending.expire()
        return RouteAnswer(chosen.node, namespace_id, len(keys), tokens, tuple(breakdowns))
