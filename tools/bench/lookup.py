"""The store's lookup hot path in-process (no gRPC): a cached prefix of ``--blocks`` blocks (2,048 =
a 32k-token prompt) looked up ``--calls`` times, plain and leased (lookup + release), under each
DRAM eviction policy. Prints the best of ``--repeats`` rounds in microseconds per call, and the
fastest and the median single call.

    .venv/bin/python -m tools.bench lookup [--policy lru,lfu,credit] [--blocks 2048] [--calls 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass

from kvstored import config
from kvstored.copy import CopyEngine
from kvstored.policy.registry import POLICIES
from kvstored.store import BlockStore, KeyRequest
from kvstored.tiers.dram import Arena
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call: the best round's mean, and the fastest and the median single call (on a
    shared machine a round is easily preempted; single calls less so)."""

    best_round: float
    fastest: float
    median: float


async def measure(policy: str, blocks: int, calls: int, repeats: int) -> tuple[Timing, Timing]:
    """(plain, leased) lookups of a ``blocks``-block cached chain under ``policy``."""
    cfg = config.build({"dram": {"capacity": 2 * blocks * BLOCK, "page_bytes": 1 << 20, "prefault": False,
                                 "policy": policy},
                        "ssd": {"enabled": False}})
    with tempfile.TemporaryDirectory() as tmp:
        arena = Arena(tmp, cfg.dram.capacity, prefault=False)
        copy = CopyEngine(arena)
        try:
            store = BlockStore(cfg, arena, copy)
            sid = store.open_session("bench", 1).session_id
            ns = store.open_namespace(Namespace()).namespace_id
            chain = block_hashes(list(range(16 * blocks)))
            for keys in (chain, block_hashes(list(range(10**7, 10**7 + 16 * 256)))):  # and a neighbour
                r = store.reserve(sid, ns, KeyRequest(hashes=keys), BLOCK)
                store.seal(sid, r.reservation_id)
            req = KeyRequest(hashes=chain)
            out = []
            for lease in (False, True):
                rounds, each = [], []
                for _ in range(repeats):
                    t = time.perf_counter()
                    for _ in range(calls):
                        c = time.perf_counter()
                        res = await store.lookup(ns, req, lease=lease, session_id=sid)
                        assert res.blocks == blocks
                        if lease:
                            store.release(sid, res.lease_id)
                        each.append(time.perf_counter() - c)
                    rounds.append((time.perf_counter() - t) / calls)
                out.append(Timing(min(rounds), min(each), statistics.median(each)))
            return out[0], out[1]
        finally:
            copy.close()
            arena.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench lookup", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=",".join(POLICIES))
    p.add_argument("--blocks", type=int, default=2048)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    for policy in a.policy.split(","):
        plain, leased = asyncio.run(measure(policy, a.blocks, a.calls, a.repeats))
        print(f"{policy:>7}: lookup {plain.best_round * 1e6:6.0f} us   leased lookup + release "
              f"{leased.best_round * 1e6:6.0f} us   ({a.blocks} blocks, best of {a.repeats} x {a.calls})"
              f"   single calls, fastest / median: lookup {plain.fastest * 1e6:.0f} / {plain.median * 1e6:.0f} us,"
              f" leased {leased.fastest * 1e6:.0f} / {leased.median * 1e6:.0f} us")
    return 0
