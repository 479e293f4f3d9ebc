"""``save`` into a fresh DRAM tier and into a full one: the cost of making room.

A daemon (SSD tier off, ``dram.policy=lru``) with a DRAM tier of ``--dram-mib``; one client
saves fresh prompts of ``--batch`` blocks of each ``--sizes`` through the SDK's ``save`` (the
arena path: a reservation, the SDK's copy into its slots, a seal), first until the tier is full,
then as many again, each of those evicting as many blocks as it stores. Prints the median
latency of a save in each phase and the phases' ratio. The reservations' slots come from blocks
just evicted in the second phase: how the daemon hands them out (one run of slots side by side,
or scattered) shows there, in the SDK's copy and in the loads of those blocks.

    .venv/bin/python -m tools.bench saves [--sizes 256KiB,2MiB] [--batches 1,32] [--dram-mib 1024]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

import kvstored
from kvstored.config import parse_size
from tools.bench.common import MiB
from tools.bench.local_daemon import local_daemon

KiB = 1 << 10


def phases(client: kvstored.Client, block_bytes: int, batch: int, dram_bytes: int) -> tuple[float, float]:
    """Median seconds per save while the tier fills, and once every save evicts."""
    ns = kvstored.Namespace(model=f"saves-{block_bytes}-{batch}")
    per_tier = max(1, dram_bytes // (block_bytes * batch))
    rows = np.ones((batch, block_bytes), np.uint8)
    filling: list[float] = []
    full: list[float] = []
    for k in range(2 * per_tier):
        keys = [hashlib.sha256(f"{block_bytes}/{batch}/{k}/{i}".encode()).digest() for i in range(batch)]
        rows[:, :8] = np.frombuffer(k.to_bytes(8, "little"), np.uint8)   # each prompt's own bytes
        began = time.perf_counter()
        result = client.save(None, rows, hashes=keys, namespace=ns)
        took = time.perf_counter() - began
        if result.stored != batch:
            raise RuntimeError(f"a save stored {result.stored} of {batch} blocks")
        # the last prompts of the filling phase may already evict (pages of other sizes, slack)
        (filling if k < per_tier * 9 // 10 else full if k >= per_tier else []).append(took)
    return float(np.median(filling)), float(np.median(full))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench saves", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256KiB,2MiB", help="block sizes (KiB/MiB suffixes)")
    p.add_argument("--batches", default="1,32", help="blocks per save")
    p.add_argument("--dram-mib", type=int, default=1024, help="the DRAM tier's capacity")
    a = p.parse_args(argv)
    dram = a.dram_mib * MiB
    print("| block | batch | save p50 µs, tier filling | save p50 µs, tier full | full ÷ filling |")
    print("|---|---:|---:|---:|---:|")
    for size in [parse_size(s.strip()) for s in a.sizes.split(",")]:
        for batch in [int(b) for b in a.batches.split(",")]:
            with local_daemon("--dram-capacity", str(dram), "--set", "dram.page_bytes=32MiB", "--set",
                              "ssd.enabled=false", "--set", "dram.policy=lru", "--log-level", "warning") as client:
                filling, full = phases(client, size, batch, dram)
            label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
            print(f"| {label} | {batch} | {filling * 1e6:.0f} | {full * 1e6:.0f} | {full / filling:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
