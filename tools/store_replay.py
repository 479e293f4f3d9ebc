"""Replay a request trace through the real block store, both tiers at once.

    python -m tools.store_replay [--trace PATH | --shape SHAPE [--requests N] [--seed S]]
                                 [--capacities 2,5,10,25,50] [--dram-share 0.25] [--policies lru,credit]
                                 [--dram-policy NAME]

``tools.trace_replay`` replays through the prefix index and one policy; this runs the same
requests through ``BlockStore`` itself (an arena, an SSD tier in a temporary directory, the
write-back, promotions), so the DRAM and SSD policies are measured together as the daemon runs
them. For each capacity (a percentage of the trace's unique full blocks) the SSD tier holds that
many blocks and the DRAM tier ``--dram-share`` of them (the tiers are inclusive: DRAM's blocks
are on SSD too once written). Each request looks its chain up (a hit in either tier counts; one on
SSD starts its promotion), then saves what it missed; the write-back copies what the SSD tier
admits before the next request, as ``ssd.max_dirty_s`` (1 s) does against the trace's gaps of
seconds. ``dram.policy`` and ``ssd.policy`` are both the policy named, on the trace's clock
(with ``--dram-policy``, DRAM's is that one in every run: which tier's policy a result comes from).
Reported against per-block LRU holding the same number of blocks as the SSD tier.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstored import config
from kvstored.copy import CopyEngine
from kvstored.index import Tier
from kvstored.policy.cost import ModelShape
from kvstored.policy.registry import DEFAULT_POLICY, POLICIES
from kvstored.store import BlockStore, KeyRequest
from kvstored.tiers.dram import Arena
from kvstored.tiers.ssd import SSDTier
from kvstored_client.contract.errors import ResourceExhausted
from kvstored_client.contract.namespace import Namespace
from tools.trace_replay import (
    DEFAULT_TRACE,
    PER_BLOCK_LRU,
    Savings,
    Trace,
    TraceClock,
    load_trace,
    replay_per_block_lru,
    trace_from_records,
)
from tools.workloads import SHAPES, generate

BLOCK = 4096        # payload bytes per block: the policies see blocks, not bytes
PAGE = 64 << 10     # 16 slots a page


@dataclass(frozen=True, slots=True)
class StoreRow:
    capacity_pct: float
    ssd_blocks: int
    dram_blocks: int
    policy: str
    hit_tokens: int
    saved_flops: float
    ratio: float        # saved FLOPs / per-block LRU's
    dram_share: float   # of the blocks hit, the share found in DRAM
    dropped: int        # blocks whose last copy went (evicted from a full SSD tier, mostly)


async def replay_store(trace: Trace, policy: str, ssd_blocks: int, dram_blocks: int, shape: ModelShape,
                       tmp: Path, dram_policy: str | None = None) -> tuple[Savings, int, int, int]:
    """The trace through a fresh store of these capacities, both tiers under ``policy`` (DRAM
    under ``dram_policy`` when given); savings, blocks hit in DRAM, blocks hit in all, blocks
    dropped."""
    pages = max(1, math.ceil(dram_blocks * BLOCK / PAGE))
    cfg = config.build({
        "dram": {"capacity": pages * PAGE, "page_bytes": PAGE, "prefault": False, "policy": dram_policy or policy,
                 "shm_dir": str(tmp)},
        "ssd": {"capacity": ssd_blocks * BLOCK, "policy": policy, "sync": False, "admission": "always",
                "high_watermark": 1.0, "low_watermark": 0.98}})
    clock = TraceClock()
    arena = Arena(str(tmp), cfg.dram.capacity, prefault=False)
    copy = CopyEngine(arena)
    tier = SSDTier(str(tmp / "ssd"), max(64 << 20, ssd_blocks * 4 * 1024), sync=False)
    store = BlockStore(cfg, arena, copy, tier, clock=clock)
    writer = asyncio.ensure_future(store.writeback_loop(0.05))
    savings = Savings(shape)
    in_dram = hit = 0
    try:
        session = store.open_session("replay", 1).session_id
        ns = store.open_namespace(Namespace(model="replay", block_bytes=BLOCK)).namespace_id
        for chain8, t in zip(trace.chains, trace.times):
            clock.set(t)
            keys = KeyRequest(hashes=[k.rjust(32, b"\0") for k in chain8])
            found = await store.lookup(ns, keys)
            savings.add(found.blocks)
            hit += found.blocks
            in_dram += found.tiers.count(Tier.DRAM)
            if found.blocks < len(chain8):
                with contextlib.suppress(ResourceExhausted):   # no room at all: stored nothing
                    r = await store.reserve_waiting(session, ns, keys, BLOCK)
                    store.seal(session, r.reservation_id)
            await store.writeback.write_back(math.inf, force=False, models=None)
            await store.finish_background()
        return savings, in_dram, hit, store.stats().dropped_blocks
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        await store.finish_background()
        tier.close()
        copy.close()
        arena.close()


def run(trace: Trace, capacities: Sequence[float], policies: Sequence[str], dram_share: float,
        shape: ModelShape | None = None, dram_policy: str | None = None) -> list[StoreRow]:
    shape = shape or ModelShape.llama3_8b()
    rows: list[StoreRow] = []
    for pct in capacities:
        ssd_blocks = max(1, int(trace.unique_blocks * pct / 100))
        dram_blocks = max(1, int(ssd_blocks * dram_share))
        base = replay_per_block_lru(trace, ssd_blocks, shape)
        rows.append(StoreRow(pct, ssd_blocks, 0, PER_BLOCK_LRU, base.hit_tokens, base.saved_flops, 1.0, 0.0, 0))
        for name in policies:
            began = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="kvstored-replay-") as tmp:
                savings, in_dram, hit, dropped = asyncio.run(
                    replay_store(trace, name, ssd_blocks, dram_blocks, shape, Path(tmp), dram_policy))
            res = savings.result()
            ratio = res.saved_flops / base.saved_flops if base.saved_flops else float("nan")
            label = name if dram_policy is None else f"{name} (DRAM: {dram_policy})"
            rows.append(StoreRow(pct, ssd_blocks, dram_blocks, label, res.hit_tokens, res.saved_flops, ratio,
                                 in_dram / hit if hit else 0.0, dropped))
            print(f"{pct:g}% {name}: {time.perf_counter() - began:.1f}s", file=sys.stderr, flush=True)
    return rows


def format_table(rows: Sequence[StoreRow]) -> str:
    out = ["| capacity | SSD / DRAM blocks | policy | hit tokens | saved prefill FLOPs | x per-block LRU | "
           "hits in DRAM | dropped |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = f"**{r.policy}** (default)" if r.policy == DEFAULT_POLICY else r.policy
        tiers = f"{r.ssd_blocks} / {r.dram_blocks}" if r.dram_blocks else f"{r.ssd_blocks}"
        share = f"{100 * r.dram_share:.0f}%" if r.policy != PER_BLOCK_LRU else ""
        dropped = str(r.dropped) if r.policy != PER_BLOCK_LRU else ""
        out.append(f"| {r.capacity_pct:g}% | {tiers} | {name} | {r.hit_tokens:,} | {r.saved_flops:.4e} | "
                   f"{r.ratio:.3f} | {share} | {dropped} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.store_replay", description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, default=None, help=f"JSONL trace (default: {DEFAULT_TRACE})")
    source.add_argument("--shape", choices=list(SHAPES), default=None, help="a synthetic trace (tools.workloads)")
    p.add_argument("--requests", type=int, default=5000, help="with --shape: how many requests (default 5000)")
    p.add_argument("--seed", type=int, default=0, help="with --shape: the random seed (default 0)")
    p.add_argument("--capacities", default="2,5,10,25,50",
                   help="percentages of the unique full blocks the SSD tier holds (default 2,5,10,25,50)")
    p.add_argument("--dram-share", type=float, default=0.25, help="DRAM's capacity as a share of SSD's (default 0.25)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"from {', '.join(POLICIES)} (default: all)")
    p.add_argument("--dram-policy", default=None, choices=list(POLICIES),
                   help="the DRAM tier's policy in every run (default: the run's policy, on both tiers)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if unknown := [x for x in policies if x not in POLICIES]:
        p.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    capacities = [float(x) for x in args.capacities.split(",") if x.strip()]
    if not 0 < args.dram_share <= 1:
        p.error("--dram-share must be in (0, 1]")
    if args.shape is not None:
        trace = trace_from_records(generate(args.shape, args.requests, args.seed), args.limit)
        print(f"shape {args.shape}, seed {args.seed}: ", end="")
    else:
        path = args.trace or DEFAULT_TRACE
        if not path.is_file():
            print(f"trace not found: {path}", file=sys.stderr)
            return 2
        trace = load_trace(path, args.limit)
    print(f"{len(trace.chains)} requests, {trace.unique_blocks} unique full blocks; DRAM holds "
          f"{args.dram_share:g} of the SSD tier's blocks; prefill FLOPs of Llama-3-8B\n")
    print(format_table(run(trace, capacities, policies, args.dram_share, dram_policy=args.dram_policy)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
