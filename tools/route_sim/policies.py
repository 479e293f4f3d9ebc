"""The routing policies compared: round robin, least-loaded, SGLang's cache-aware policy with
its default thresholds, Dynamo's default cost, llm-d's prefix scorer with its default weights,
kvstored's router (the real code: index, load board, calibration, TTFT ledger) and an oracle
that knows each node's exact queue and cache. Each is written from its project's documented
behaviour (../shared/REFERENCE.md, "Routing anchors"), not from its code.

Every policy sees the same things a router of its kind would: the global index fed by the
nodes' events (Dynamo, llm-d, kvstored), the requests it routed itself (SGLang, Dynamo's and
llm-d's load signals, round robin), periodic load reports (kvstored) or the truth (oracle).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Protocol

import numpy as np

from kvstored.policy.routing import NodeCosts
from kvstored.router.calibration import Calibration
from kvstored.router.index import GlobalIndex
from kvstored.router.load import LoadBoard
from kvstored.router.reports import NodeReports
from kvstored.router.router import Defaults, RouteQuery, Router
from kvstored_client.contract.namespace import Namespace
from tools.route_sim.cluster import Cluster, Req


class Policy(Protocol):
    name: str

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        """(node, node to pull the prefix from or None)."""
        ...

    def routed(self, node: int, req: Req, now: float) -> None:
        """The request went to ``node`` (router-local bookkeeping)."""


class RoundRobin:
    name = "round robin"

    def __init__(self, cluster: Cluster) -> None:
        self._k = len(cluster.nodes)
        self._next = 0

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        self._next = (self._next + 1) % self._k
        return self._next, None

    def routed(self, node: int, req: Req, now: float) -> None:
        pass


class LeastLoaded:
    """Fewest requests waiting for their first token (as the router counts them)."""

    name = "least-loaded"

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._rr = 0

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        nodes = self._cluster.nodes
        for n in nodes:
            n.settle(now)
        self._rr += 1
        k = len(nodes)
        return min(range(k), key=lambda i: (len(nodes[i].waiting), (i - self._rr) % k)), None

    def routed(self, node: int, req: Req, now: float) -> None:
        pass


class SGLangCacheAware:
    """An approximate tree per worker from the requests routed to it (LRU, bounded); shortest
    queue when the load is imbalanced (max - min > 64 and max > 1.5 x min), else the best match
    if its share of the prompt is above 0.3, else the worker with the smallest tree. Load is the
    requests routed and not finished, as the gateway counts them."""

    name = "SGLang cache-aware"
    BALANCE_ABS, BALANCE_REL, THRESHOLD = 64, 1.5, 0.3

    def __init__(self, cluster: Cluster, tree_blocks: int) -> None:
        self._cluster = cluster
        self._trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in cluster.nodes]
        self._max = tree_blocks

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        nodes = self._cluster.nodes
        for n in nodes:
            n.settle(now)
        loads = [len(n.active) for n in nodes]
        if max(loads) - min(loads) > self.BALANCE_ABS and max(loads) > self.BALANCE_REL * min(loads):
            return int(np.argmin(loads)), None
        matches = []
        for tree in self._trees:
            m = 0
            while m < len(req.chain) and req.chain[m] in tree:
                m += 1
            matches.append(m)
        best = int(np.argmax(matches))
        if req.chain and matches[best] / len(req.chain) > self.THRESHOLD:
            return best, None
        return min(range(len(nodes)), key=lambda i: len(self._trees[i])), None

    def routed(self, node: int, req: Req, now: float) -> None:
        tree = self._trees[node]
        for b in req.chain:
            tree[b] = None
            tree.move_to_end(b)
        while len(tree) > self._max:
            tree.popitem(last=False)


class _IndexFed:
    """A policy that reads the global index (the nodes' events) for overlaps."""

    def __init__(self, cluster: Cluster, index: GlobalIndex) -> None:
        self._cluster = cluster
        self._index = index
        self._names = [n.name for n in cluster.nodes]

    def overlaps(self, req: Req) -> dict[str, tuple[int, int, int, int]]:
        h = self._index.holdings(self._cluster.namespace_id, np.asarray(req.chain, np.uint64))
        return {node: (int(p), int(g), int(d), int(s))
                for node, p, g, d, s in zip(h.nodes, h.prefix, h.gpu, h.dram, h.ssd)}


class DynamoCost(_IndexFed):
    """``prefill_load_scale · max(prefill blocks - credit, 0) + decode blocks`` with the credit
    ``1.0 · device + 0.75 · host + 0.25 · disk`` overlap blocks (decay 1); prefill blocks are the
    request's plus those the router sent the worker that have not finished prefill, decode blocks
    those of its requests decoding; argmin (temperature 0). Router-local load."""

    name = "Dynamo cost"

    def __init__(self, cluster: Cluster, index: GlobalIndex) -> None:
        super().__init__(cluster, index)
        self._inflight: list[list[tuple[float, float, int]]] = [[] for _ in cluster.nodes]  # (prefill end, end, blocks)

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        over = self.overlaps(req)
        n = len(req.chain) + (1 if req.tokens % self._cluster.engine.block_tokens else 0)
        costs = []
        for i, name in enumerate(self._names):
            _, g, d, s = over.get(name, (0, 0, 0, 0))
            credit = 1.0 * g + 0.75 * d + 0.25 * s
            flights = self._inflight[i] = [f for f in self._inflight[i] if f[1] > now]
            prefill = sum(b for pe, _, b in flights if pe > now) + max(n - credit, 0.0)
            decode = sum(b for pe, _, b in flights if pe <= now)
            costs.append(1.0 * prefill + decode)
        return int(np.argmin(costs)), None

    def routed(self, node: int, req: Req, now: float) -> None:
        pass

    def started(self, node: int, req: Req, prefill_end: float, end: float, new_blocks: int) -> None:
        self._inflight[node].append((prefill_end, end, new_blocks))


class LlmdPrefix(_IndexFed):
    """llm-d's scorers with their default weights: the prefix score (consecutive blocks from block
    0, each its best tier's weight: GPU 1.0, CPU 0.8), KV-cache utilisation (lower is better) and
    queue (requests waiting, lower is better), each min-max normalised, weighted 3 / 2 / 2."""

    name = "llm-d prefix"

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        over = self.overlaps(req)
        nodes = self._cluster.nodes
        for n in nodes:
            n.settle(now)
        prefix = np.array([(lambda o: 1.0 * o[1] + 0.8 * o[2])(over.get(name, (0, 0, 0, 0))) for name in self._names])
        util = np.array([len(n.cache.index) / n.cache.capacity for n in nodes])
        queue = np.array([len(n.waiting) for n in nodes], float)

        def norm(x: np.ndarray) -> np.ndarray:
            span = x.max() - x.min()
            return np.ones_like(x) if span == 0 else (x - x.min()) / span

        score = 3 * norm(prefix) + 2 * norm(-util) + 2 * norm(-queue)
        return int(np.argmax(score)), None

    def routed(self, node: int, req: Req, now: float) -> None:
        pass


class Kvstored:
    """kvstored's router, the real code: it sees the index (events), load reports every
    ``report_s`` (each node's predicted prefill backlog) plus its own routing since, and the
    measured prefills (its calibration). It may send a request to X and have X pull from Y."""

    name = "kvstored router"

    def __init__(self, cluster: Cluster, index: GlobalIndex, namespace: Namespace, clock, rng: random.Random,  # type: ignore[no-untyped-def]
                 prior_flops_per_s: float, spread: float) -> None:
        self._cluster = cluster
        self._namespace = namespace
        e = cluster.engine
        self.load = LoadBoard(clock)
        self.calibration = Calibration(prior_flops_per_s)
        costs = NodeCosts(queue_s=0.0, prefill_flops_per_s=prior_flops_per_s, decode_s=e.decode_s,
                          dram_bytes_per_s=e.dram_bytes_per_s, peer_bytes_per_s=e.peer_bytes_per_s)
        names = [n.name for n in cluster.nodes]
        self.router = Router(index, self.load, self.calibration, NodeReports(), lambda: names, rng,
                             Defaults(costs, spread=spread))
        self._index_of = {name: i for i, name in enumerate(names)}

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        q = RouteQuery(self._namespace, block_hashes=req.chain, tokens=req.tokens)
        answer = self.router.route(q)
        chosen = next(c for c in answer.candidates if c.node == answer.node)
        return self._index_of[answer.node], self._index_of[chosen.pull_from] if chosen.pull_from else None

    def routed(self, node: int, req: Req, now: float) -> None:
        pass

    def report(self, now: float) -> None:
        for n in self._cluster.nodes:
            self.load.report(n.name, n.backlog_s(now))


class Oracle:
    """Knows every node's exact queue and cache: the lowest true TTFT, pulls included."""

    name = "oracle"

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def choose(self, req: Req, now: float) -> tuple[int, int | None]:
        c = self._cluster
        matches = [n.cache.match(req.chain) for n in c.nodes]
        donor = int(np.argmax(matches))
        best = min(range(len(c.nodes)), key=lambda i: c.exact_ttft(i, req, now, donor)[0])
        return best, donor if c.exact_ttft(best, req, now, donor)[2] else None

    def routed(self, node: int, req: Req, now: float) -> None:
        pass
