"""Workload 5: bytes of Python heap per cached block, measured with tracemalloc.

Inserts ``--blocks`` blocks as chains of 2,048 (32k-token prompts) into a ``PrefixIndex`` the way
the store does (32-byte sha256 keys, a parent, an arena offset) and seals them, then divides what
tracemalloc counts as still allocated by the number of blocks (the index alone; the keys are
counted: the index keeps them alive). Then the default eviction policy starts tracking every block,
as a tier's policy does, and the same is counted again (index and policy records together).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from tools.bench.common import worker_output

CHAIN = 2048


def measure(n_blocks: int) -> dict[str, Any]:
    from kvstored import index as index_mod
    from kvstored.policy.registry import DEFAULT_POLICY, make_policy

    seal = sealer(index_mod)

    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    t0 = time.perf_counter()
    index = index_mod.PrefixIndex(1)
    chains = fill(index, n_blocks, seal)
    elapsed = time.perf_counter() - t0
    gc.collect()
    index_only, _ = tracemalloc.get_traced_memory()
    # the lists of chains are the benchmark's, not the index's: left out of both counts
    listing = sys.getsizeof(chains) + sum(sys.getsizeof(c) for c in chains)
    policy = make_policy(DEFAULT_POLICY, lambda: 0.0, n_blocks)
    for chain in chains:
        policy.inserted(chain)  # type: ignore[arg-type]
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(index) == n_blocks and len(policy) == n_blocks
    return {"blocks": n_blocks, "bytes_per_block": (index_only - base - listing) / n_blocks,
            "with_policy_bytes_per_block": (current - base - listing) / n_blocks, "policy": DEFAULT_POLICY,
            "peak_bytes_per_block": (peak - base) / n_blocks, "build_s": elapsed}


def fill(index: object, n_blocks: int, seal: Callable[[object], None], first: int = 0) -> list[list[object]]:
    """Insert ``n_blocks`` sealed, unpinned blocks into ``index`` as chains of CHAIN (32-byte
    sha256 keys, a parent, an arena offset), numbered from ``first``; the chains."""
    chains: list[list[object]] = []
    seed = hashlib.sha256(b"kvbench-index").digest()
    made = first
    slot = 4096
    while made < first + n_blocks:
        parent = None
        key = seed
        chain = []
        for _ in range(min(CHAIN, first + n_blocks - made)):
            key = hashlib.sha256(key + made.to_bytes(8, "little")).digest()
            parent = index.insert(key, parent, made * slot)  # type: ignore[attr-defined]
            parent.pins = 0
            seal(parent)
            chain.append(parent)
            made += 1
        chains.append(chain)
    return chains


def sealer(index_mod: object) -> Callable[[object], None]:
    """How to mark a block sealed in this version of kvstored.index (state enum or flag bits)."""
    state = getattr(index_mod, "BlockState", None)
    if state is not None:
        def seal(block: object) -> None:
            block.state = state.SEALED  # type: ignore[attr-defined]
        return seal
    bit = index_mod.SEALED  # type: ignore[attr-defined]

    def seal_flag(block: object) -> None:
        block.flags |= bit  # type: ignore[attr-defined]
    return seal_flag


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with worker_output(a.out) as result:
        result.update(measure(a.blocks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
