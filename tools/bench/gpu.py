"""GPU copy benchmark (CUDA hosts only): D2H and H2D of 2 MiB blocks through the daemon
(save_blocks / load_blocks from torch tensors) next to a plain cudaMemcpyAsync between the same
kind of pinned host and device buffers, in the same run. Prints a Markdown table; without a CUDA
device it says so and exits 0. ``tools/gpu-check`` runs it.

    python -m tools.bench gpu
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvstored
from tools.bench.local_daemon import local_daemon

BLOCKS, RUNS = 64, 7
SHAPE = (2, 256, 16, 8, 128)  # per layer, bf16; 32 layers -> 2 MiB per block


def plain(nbytes: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h, h2d = [], []
    for _ in range(RUNS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(d2h), statistics.median(h2d)


def main(argv: list[str] | None = None) -> int:
    # no options; a parser all the same, so that --help describes the run instead of starting it
    argparse.ArgumentParser(prog="python -m tools.bench gpu", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    with local_daemon("--dram-capacity", "8GiB", "--set", "ssd.enabled=false") as client:
        kv = [torch.randn(SHAPE, device="cuda").to(torch.bfloat16) for _ in range(32)]
        buffers = client.register_buffers(kv, block_dim=1, namespace=kvstored.Namespace(model="bench-gpu"))
        nbytes = BLOCKS * buffers.block_bytes
        save, load = [], []
        for run in range(RUNS):
            tokens = [run * 100_000 + i for i in range(16 * BLOCKS)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            client.save_blocks(buffers, list(range(BLOCKS)), tokens)
            save.append(nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            client.load_blocks(buffers, list(range(BLOCKS, 2 * BLOCKS)), tokens)
            load.append(nbytes / (time.perf_counter() - t) / 1e9)
        d2h, h2d = plain(nbytes)
        s, ld = statistics.median(save), statistics.median(load)
        print(f"\n{BLOCKS} blocks of {buffers.block_bytes >> 20} MiB, medians of {RUNS} runs\n")
        print("| direction | through kvstored GB/s | plain cudaMemcpyAsync GB/s | ratio |")
        print("|---|---|---|---|")
        print(f"| D2H (save_blocks) | {s:.1f} | {d2h:.1f} | {s / d2h:.2f} |")
        print(f"| H2D (load_blocks) | {ld:.1f} | {h2d:.1f} | {ld / h2d:.2f} |")
        client.unregister_buffers(buffers)
    return 0
