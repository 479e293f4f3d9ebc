"""Workload 5: bytes of Python heap per cached block in the radix index, measured with tracemalloc.

Inserts ``--blocks`` blocks as chains of 2,048 (32k-token prompts) into a ``PrefixIndex`` the way
the store does (32-byte sha256 keys, a parent, an arena offset), seals them and links them into the
LRU order, then divides what tracemalloc counts as still allocated by the number of blocks. The
keys are counted: the index is what keeps them alive.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import time
import tracemalloc

from tools.bench.common import worker_output

CHAIN = 2048


def measure(n_blocks: int) -> dict[str, float]:
    from kvstored import index as index_mod
    from kvstored.policy.eviction import LRUOrder

    seal = _sealer(index_mod)

    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    t0 = time.perf_counter()
    index = index_mod.PrefixIndex(1)
    lru = LRUOrder()
    seed = hashlib.sha256(b"kvbench-index").digest()
    made = 0
    slot = 4096
    while made < n_blocks:
        parent = None
        key = seed
        for _ in range(min(CHAIN, n_blocks - made)):
            key = hashlib.sha256(key + made.to_bytes(8, "little")).digest()
            parent = index.insert(key, parent, made * slot)
            parent.pins = 0
            seal(parent)
            lru.touch(parent)
            made += 1
    elapsed = time.perf_counter() - t0
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(index) == n_blocks
    return {"blocks": n_blocks, "bytes_per_block": (current - base) / n_blocks,
            "peak_bytes_per_block": (peak - base) / n_blocks, "build_s": elapsed}


def _sealer(index_mod: object):  # type: ignore[no-untyped-def]
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
