"""Copies into and out of the daemon's arena by the page size of its shared-memory directory: for
each directory given (e.g. ``/dev/shm`` and a tmpfs mounted with ``huge=within_size``) an arena
(:class:`kvstored.tiers.dram.Arena`, pre-faulted as the daemon makes it) of ``--arena-mib``, and a
batch of ``--batch`` blocks copied row by row between the process's own (heap) memory and slots
at random offsets in it (put: heap -> arena, get: arena -> heap), as the SDK's ``save``/``load``
copy; beside them the same copies between two heap buffers. Directories are measured in turn,
round after round, so that a busy machine weighs on each alike. Prints each arena's huge-page
share and the median GB/s of each copy.

    .venv/bin/python -m tools.bench pages --dirs /dev/shm,HUGE_DIR [--rounds 5]

A huge-page tmpfs, for a run as root (a private mount namespace, gone with the command):

    d=$(mktemp -d); unshare -m sh -c "mount -t tmpfs -o size=2g,huge=within_size tmpfs $d && \\
        .venv/bin/python -m tools.bench pages --dirs /dev/shm,$d"
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvstored.tiers.dram import Arena

KiB = 1 << 10
MiB = 1 << 20


def _copy_rows(dst: list[np.ndarray], src: list[np.ndarray]) -> float:
    started = time.perf_counter()
    for d, s in zip(dst, src):
        np.copyto(d, s)
    return time.perf_counter() - started


def _round(target: np.ndarray, heap: np.ndarray, block: int, batch: int, rng: np.random.Generator,
           calls: int) -> dict[str, list[float]]:
    """Seconds per batch copy into (put) and out of (get) ``target`` at random block slots."""
    slots = target.size // block
    rows = [heap[i * block:(i + 1) * block] for i in range(batch)]
    out: dict[str, list[float]] = {"put": [], "get": []}
    for _ in range(calls):
        at = rng.choice(slots, batch, replace=False) * block
        views = [target[o:o + block] for o in at.tolist()]
        out["put"].append(_copy_rows(views, rows))
        at = rng.choice(slots, batch, replace=False) * block
        views = [target[o:o + block] for o in at.tolist()]
        out["get"].append(_copy_rows(rows, views))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--dirs", default="/dev/shm", help="comma-separated shared-memory directories")
    p.add_argument("--arena-mib", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10, help="batch copies per round, block size and target")
    a = p.parse_args(argv)
    capacity = a.arena_mib * MiB
    rng = np.random.default_rng(0)
    targets: dict[str, np.ndarray] = {}
    arenas = []
    try:
        for directory in a.dirs.split(","):
            arena = Arena(directory, capacity, prefault=True)
            arenas.append(arena)
            huge = arena.huge_page_bytes()
            targets[f"arena in {directory}"] = arena.buf
            print(f"arena in {directory}: {capacity >> 20} MiB, "
                  f"{'unknown' if huge is None else f'{huge >> 20} MiB'} on huge pages", flush=True)
        private = np.empty(capacity, np.uint8)
        private[::4096] = 1   # (numpy asks for huge pages for a heap buffer this large)
        targets["heap (the process's own memory)"] = private
        results: dict[tuple[str, int, str], list[float]] = {}
        for block in (2 * MiB, 256 * KiB):
            heap = np.random.default_rng(1).integers(0, 255, a.batch * block, dtype=np.uint8)
            for _ in range(a.rounds):
                for name, target in targets.items():
                    for op, times in _round(target, heap, block, a.batch, rng, a.calls).items():
                        results.setdefault((name, block, op), []).extend(times)
        for (name, block, op), times in results.items():
            median = float(np.median(times))
            print(f"{op} {block // KiB:>5} KiB x {a.batch}, {name}: median {median * 1e6:8.0f} us "
                  f"({a.batch * block / median / 1e9:5.2f} GB/s)", flush=True)
    finally:
        for arena in arenas:
            arena.close()
    return 0
