"""The daemon's copy engine alone, in-process (no gRPC): a batch of ``--batch`` blocks copied from
registered engine buffers into arena slots (save) and back (load), the blocks consecutive in the
engine and side by side in the arena, as a fresh save's are. Layouts: one tensor holding whole
blocks, and one tensor per layer (``--layers``, each ``(2, blocks, bytes)``: a block's K row and V
row, ``blocks`` rows apart), so a block is ``2 x layers`` rows. Prints the per-call minimum and
median over ``--calls`` calls, and the median's GB/s.

    .venv/bin/python -m tools.bench copy [--batch 32] [--layers 32] [--calls 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstored.buffers import RegisteredBuffers, TensorSource
from kvstored.copy import CopyEngine
from kvstored.tiers.dram import Arena
from kvstored_client.contract.layout import TensorLayout

KiB = 1 << 10


def _sources(shm_dir: Path, layers: int, block_bytes: int, blocks: int) -> list[TensorSource]:
    """``layers`` tensors of ``blocks`` blocks in one shared-memory file, filled with a pattern."""
    per = block_bytes // layers // 2   # one of a block's rows in one layer
    extent = 2 * blocks * per
    path = shm_dir / "engine-kv"
    with open(path, "wb") as f:
        f.truncate(layers * extent)
    data = np.memmap(path, np.uint8, "r+")
    data[:] = np.arange(data.size, dtype=np.uint64).astype(np.uint8)
    data.flush()
    del data
    layout = TensorLayout((2, blocks, per), (blocks * per, per, 1), "uint8", 1)
    return [TensorSource(path.name, i * extent, layout) for i in range(layers)]


async def _measure(engine: CopyEngine, buffers: RegisteredBuffers, batch: int, slot: int,
                   calls: int) -> dict[str, tuple[float, float]]:
    ids = np.arange(batch, dtype=np.uint32)
    offsets = [i * slot for i in range(batch)]
    out = {}
    for name, to_arena in (("save", True), ("load", False)):
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            if to_arena:
                await engine.to_arena(buffers, ids, offsets)
            else:
                await engine.from_arena(buffers, ids, offsets)
            times.append(time.perf_counter() - t)
        times.sort()
        out[name] = (times[0], times[len(times) // 2])
    return out


def measure(layers: int, block_bytes: int, batch: int, calls: int) -> dict[str, tuple[float, float]]:
    """{save, load}: (minimum, median) seconds per call of a ``batch``-block copy."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORED_SHM_DIR", "/dev/shm")) as tmp:
        buffers = RegisteredBuffers(1, tmp, _sources(Path(tmp), layers, block_bytes, batch))
        arena = Arena(tmp, batch * buffers.block_bytes, prefault=True)
        engine = CopyEngine(arena)
        try:
            return asyncio.run(_measure(engine, buffers, batch, buffers.block_bytes, calls))
        finally:
            engine.close()
            buffers.close()
            arena.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--calls", type=int, default=30)
    a = p.parse_args(argv)
    for block_bytes in (256 * KiB, 2048 * KiB):
        for layers in (1, a.layers):
            r = measure(layers, block_bytes, a.batch, a.calls)
            gb = a.batch * block_bytes / 1e9
            print(f"{block_bytes // KiB:>5} KiB x {a.batch}, {layers:>3} tensor(s): " + "   ".join(
                f"{op} min {lo * 1e6:7.0f} us, median {mid * 1e6:7.0f} us ({gb / mid:5.2f} GB/s)"
                for op, (lo, mid) in r.items()), flush=True)
    return 0
