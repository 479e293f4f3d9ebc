"""TTFT of a real (random-weight) Llama on CPU: a prompt restored from kvstored's DRAM tier vs a
fresh prefill, for 1k, 4k and 8k tokens. Starts its own daemon; prints a Markdown table.

    python -m tools.bench model [--tokens 1024,4096,8192] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore")   # before transformers is imported: its import-time warnings too

from tools.bench.local_daemon import local_daemon  # noqa: E402
from tools.tiny_engine import Engine, ModelShape  # noqa: E402

SHAPE = ModelShape(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768, vocab=32000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096,8192")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.tokens.split(",")]
    with local_daemon("--dram-capacity", "2GiB", "--set", "ssd.enabled=false", "--log-level", "warning") as client:
        engine = Engine(client, SHAPE, num_blocks=max(lengths) // 16 + 1)
        for _ in range(2):  # warm up both paths (allocator, page tables, first daemon calls)
            warm = np.random.default_rng(99).integers(0, SHAPE.vocab, size=min(lengths) + 7)
            engine.run(warm, use_store=False)
            engine.run(warm)
            engine.run(warm)
        rows = []
        for n in lengths:
            prefill, restore = [], []
            for run in range(args.runs):
                prompt = np.random.default_rng(1000 * n + run).integers(0, SHAPE.vocab, size=n + 7)
                t = time.perf_counter()
                engine.run(prompt, use_store=False)
                prefill.append(time.perf_counter() - t)
                engine.run(prompt)  # stores it
                t = time.perf_counter()
                turn = engine.run(prompt)  # restored: only the 7-token tail is computed
                restore.append(time.perf_counter() - t)
                assert turn.cached_tokens == n
            p, r = statistics.median(prefill), statistics.median(restore)
            rows.append((n, p, r))
        print(f"\nTTFT, tiny Llama {SHAPE.hidden}x{SHAPE.layers} (fp32, CPU), medians of {args.runs} runs\n")
        print("| prompt tokens | fresh prefill ms | restored from DRAM ms | restore / prefill |")
        print("|---|---|---|---|")
        for n, p, r in rows:
            print(f"| {n} | {p * 1e3:.1f} | {r * 1e3:.1f} | {r / p:.3f} |")
        engine.close()
    return 0
