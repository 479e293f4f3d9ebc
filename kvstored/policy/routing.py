"""Routing by estimated time to first token (DESIGN.md, "Cost model"): for each candidate node,

    TTFT = queue + max(prefill of the uncached suffix, time to bring the cached KV) + first-block decode

where the cached KV is what the node holds (its GPU, DRAM and SSD blocks, each tier at its own
read speed) or, as a costed option, what it would pull over the peer link from the node holding
the longest prefix ("route to X, let X pull from Y"). The choice is the lowest TTFT; candidates
within ``spread`` of it are near-equal, and two of them drawn at random (the power of two
choices) are compared, so a prefix every node holds (a shared system prompt) does not send every
request to one node. Pure: figures in, a decision out; randomness is the caller's ``rng``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored.policy.cost import ModelShape, prefix_prefill_flops


@dataclass(frozen=True, slots=True)
class NodeCosts:
    """What a node's TTFT depends on besides the prompt: its queue (seconds of prefill work ahead
    of a new request), its prefill speed (``overhead + flops / flops_per_s``), its tiers' read
    speeds, its peer link's, and the decode time of a first block."""

    queue_s: float
    prefill_flops_per_s: float
    prefill_overhead_s: float = 0.0
    dram_bytes_per_s: float = 19e9
    ssd_bytes_per_s: float = 1.85e9
    ssd_latency_s: float = 1e-4
    peer_bytes_per_s: float = 5e9
    decode_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Held:
    """What one node holds of the request's chain: ``prefix`` leading blocks, ``gpu``, ``dram``
    and ``ssd`` of them fastest in that tier (they add up to ``prefix``)."""

    prefix: int
    gpu: int = 0
    dram: int = 0
    ssd: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    tokens: int          # the prompt's length
    block_tokens: int    # tokens per block
    block_bytes: int     # KV bytes of one block on one node


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One candidate's estimate: ``ttft_s = queue_s + max(prefill_s, fetch_s) + decode_s``."""

    node: str
    ttft_s: float
    queue_s: float
    prefill_s: float
    fetch_s: float
    decode_s: float
    cached_blocks: int     # blocks it would not prefill (its own and pulled)
    local_blocks: int
    pulled_blocks: int = 0
    pull_from: str = ""


def prefill_seconds(shape: ModelShape, tokens: int, cached_tokens: int, costs: NodeCosts) -> float:
    """Prefill time of tokens ``cached_tokens .. tokens`` on a node (no work, no overhead)."""
    if cached_tokens >= tokens:
        return 0.0
    flops = prefix_prefill_flops(shape, tokens, 1) - prefix_prefill_flops(shape, cached_tokens, 1)
    return costs.prefill_overhead_s + flops / costs.prefill_flops_per_s


def _local_fetch(held: Held, blocks: int, nbytes: int, costs: NodeCosts) -> float:
    """Time to bring the first ``blocks`` of what ``held`` says into the engine: DRAM blocks,
    then SSD ones (the slower tiers hold the deeper blocks of a prefix); GPU blocks are there."""
    blocks = min(blocks, held.prefix)
    on_gpu = min(held.gpu, blocks)
    in_dram = min(held.dram, blocks - on_gpu)
    on_ssd = max(0, blocks - on_gpu - in_dram)
    seconds = in_dram * nbytes / costs.dram_bytes_per_s
    if on_ssd:
        seconds += costs.ssd_latency_s + on_ssd * nbytes / costs.ssd_bytes_per_s
    return seconds


def estimate(node: str, held: Held, request: Request, shape: ModelShape, costs: NodeCosts,
             donor: tuple[str, Held, NodeCosts] | None = None) -> Breakdown:
    """The better of serving from what ``node`` holds and pulling the rest of ``donor``'s longer
    prefix first (when there is a donor holding more)."""
    bt = request.block_tokens
    local = held.prefix
    cached_tokens = min(local * bt, request.tokens)
    # a fully cached prompt still computes its last token: the last block is prefilled again
    own_prefill = prefill_seconds(shape, request.tokens, min(cached_tokens, request.tokens - 1), costs)
    own_fetch = _local_fetch(held, local, request.block_bytes, costs)
    best = Breakdown(node, costs.queue_s + max(own_prefill, own_fetch) + costs.decode_s, costs.queue_s,
                     own_prefill, own_fetch, costs.decode_s, local, local)
    if donor is not None and donor[1].prefix > local and donor[0] != node:
        name, dheld, dcosts = donor
        extra = dheld.prefix - local
        # the donor reads the blocks from its tiers while they cross the link: the slower of the two
        send = _local_fetch(dheld, dheld.prefix, request.block_bytes, dcosts) \
            - _local_fetch(dheld, local, request.block_bytes, dcosts)
        link = extra * request.block_bytes / min(costs.peer_bytes_per_s, dcosts.peer_bytes_per_s)
        fetch = max(own_fetch, max(send, link))
        tokens = min(dheld.prefix * bt, request.tokens - 1)
        prefill = prefill_seconds(shape, request.tokens, tokens, costs)
        ttft = costs.queue_s + max(prefill, fetch) + costs.decode_s
        if ttft < best.ttft_s:
            best = Breakdown(node, ttft, costs.queue_s, prefill, fetch, costs.decode_s, dheld.prefix, local, extra,
                             name)
    return best


def estimate_all(request: Request, shape: ModelShape, held: dict[str, Held],
                 costs: dict[str, NodeCosts], donors: dict[str, Held] | None = None) -> list[Breakdown]:
    """Every candidate (the nodes in ``costs``; what they hold from ``held``, else nothing),
    each with the pull option from the node holding the longest prefix in ``donors`` (default
    ``held``: a caller that counts blocks not there yet leaves them out of what can be pulled)."""
    donor: tuple[str, Held, NodeCosts] | None = None
    for node, h in (held if donors is None else donors).items():
        if node in costs and (donor is None or h.prefix > donor[1].prefix):
            donor = (node, h, costs[node])
    return [estimate(node, held.get(node, Held(0)), request, shape, c, donor) for node, c in sorted(costs.items())]


def choose(breakdowns: Sequence[Breakdown], rng: random.Random, spread: float = 0.05,
           spread_s: float = 1e-3) -> Breakdown:
    """The lowest TTFT; among the candidates within ``spread`` (relative) or ``spread_s`` of it,
    the better of two drawn at random. ValueError when there is no candidate."""
    if not breakdowns:
        raise ValueError("no candidate node")
    best = min(b.ttft_s for b in breakdowns)
    near = [b for b in breakdowns if b.ttft_s <= best * (1 + spread) + spread_s]
    if len(near) == 1:
        return near[0]
    a, b = rng.sample(near, 2)
    return a if (a.ttft_s, a.queue_s) <= (b.ttft_s, b.queue_s) else b
