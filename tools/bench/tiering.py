"""The seed's tiering scenario, made into numbers: for DRAM, SSD and a peer, a block's prefill
cost against the cost of reading it from that tier and writing it into the engine's (the
inequality ``prefill_cost(block) > read_cost(slow) + write_cost(fast)``), where it breaks even,
and the TTFT of a prompt served from each tier against recomputing it, measured next to the
cost model's prediction.

    python -m tools.bench tiering [--tokens 1024,4096] [--runs 3] [--out DIR]

Two daemons, peers of each other; a random-weight Llama on CPU (tools/tiny_engine.py, the shape
``python -m tools.bench model`` uses) whose KV lives in buffers registered with daemon A. Per
prompt: a fresh prefill; restored from A's DRAM; from A's SSD (flushed, then evicted from DRAM);
from B, A's copy evicted (A pulls the prompt from B, then loads it). The prediction is the
ledger ``max(prefill of what is not cached, time to bring the cached blocks) + overhead`` with
the prefill rate fitted from the fresh prefills (``kvstored.policy.prefill_fit``), the reference
machine's tier speeds (REFERENCE.md: DRAM 19 GB/s, SSD reads 1.85 GB/s, loopback TCP 5.5 GB/s)
and the overhead measured as the DRAM restore's excess over its prediction. The break-even table
uses the same speeds for this model and for Llama-3-8B at 4e14 FLOP/s (an H100-class GPU) with
2 MiB blocks of 16 tokens. Writes ``results.json`` (and ``tiering.png`` when matplotlib is
installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

warnings.filterwarnings("ignore")   # before transformers is imported: its import-time warnings too

from kvstored.policy.cost import ModelShape as CostShape  # noqa: E402
from kvstored.policy.cost import TierCosts, break_even, prefix_prefill_flops  # noqa: E402
from kvstored.policy.prefill_fit import PrefillFit  # noqa: E402
from tools.bench.chart import render  # noqa: E402
from tools.bench.local_daemon import local_daemon  # noqa: E402
from tools.bench.model import SHAPE  # noqa: E402
from tools.tiny_engine import BLOCK, Engine  # noqa: E402

DRAM = TierCosts("dram", 19e9, 19e9)
SSD = TierCosts("ssd", 1.85e9, 1.1e9)
PEER = TierCosts("peer", 5.5e9, 5.5e9)
TIERS = (DRAM, SSD, PEER)


def tiny_cost_shape() -> CostShape:
    """The tiny engine's model as the cost model sees it: the weights a token touches."""
    d, layers, inter, heads, kv = SHAPE.hidden, SHAPE.layers, SHAPE.intermediate, SHAPE.heads, SHAPE.kv_heads
    head = d // heads
    per_layer = d * d * 2 + 2 * d * kv * head + 3 * d * inter   # q and o, k and v, the MLP
    return CostShape(params=layers * per_layer + SHAPE.vocab * d, layers=layers, d_model=d, kv_heads=kv,
                     head_dim=head)


def block_bytes() -> int:
    return 2 * SHAPE.layers * SHAPE.kv_heads * (SHAPE.hidden // SHAPE.heads) * 4 * BLOCK   # K and V, fp32


def measure(lengths: list[int], runs: int) -> dict[str, Any]:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    static = f"a=127.0.0.1:{ports[0]},b=127.0.0.1:{ports[1]}"
    common = ("--dram-capacity", "1GiB", "--set", "dram.page_bytes=32MiB", "--log-level", "warning", "--set",
              "peers.token=bench", "--set", f"peers.static={static}")
    out: dict[str, Any] = {"tokens": lengths, "fresh": {}, "dram": {}, "ssd": {}, "peer": {}}
    with local_daemon(*common, "--set", f"peers.listen=127.0.0.1:{ports[0]}", "--set", "peers.node_id=a") as a, \
            local_daemon(*common, "--set", f"peers.listen=127.0.0.1:{ports[1]}", "--set", "peers.node_id=b") as b:
        blocks = max(lengths) // BLOCK + 1
        ea, eb = Engine(a, SHAPE, num_blocks=blocks), Engine(b, SHAPE, num_blocks=blocks)
        try:
            warm = np.random.default_rng(99).integers(0, SHAPE.vocab, size=min(lengths) + 7)
            for _ in range(2):
                ea.run(warm, use_store=False)
                ea.run(warm)
                ea.run(warm)
            for n in lengths:
                for key in ("fresh", "dram", "ssd", "peer"):
                    out[key][n] = []
                for run in range(runs):
                    prompt = np.random.default_rng(1000 * n + run).integers(0, SHAPE.vocab, size=n + 7)
                    out["fresh"][n].append(ea.run(prompt, use_store=False).ttft_s)
                    ea.run(prompt)                       # stored in A's DRAM
                    out["dram"][n].append(ea.run(prompt).ttft_s)
                    a.flush()
                    a.evict(tier="dram")
                    turn = ea.run(prompt)                # read up from A's SSD
                    assert turn.cached_tokens == n, turn.cached_tokens
                    out["ssd"][n].append(turn.ttft_s)
                    eb.run(prompt)                       # B computes and holds it
                    a.evict()
                    start = time.perf_counter()
                    a.pull(prompt, namespace=ea.buffers.namespace)
                    turn = ea.run(prompt)
                    assert turn.cached_tokens == n, turn.cached_tokens
                    out["peer"][n].append(time.perf_counter() - start)
                    a.evict()
                    b.evict()
        finally:
            ea.close()
            eb.close()
    return out


def predict(measured: dict[str, Any]) -> dict[str, Any]:
    """The ledger's TTFT per tier and length, with the prefill rate fitted from the fresh runs."""
    shape = tiny_cost_shape()
    fit = PrefillFit(1e10)
    for n in measured["tokens"]:
        for seconds in measured["fresh"][n]:
            fit.observe(prefix_prefill_flops(shape, n + 7, 1), seconds)
    speed = fit.speed()
    nbytes = block_bytes()
    pred: dict[str, Any] = {"flops_per_s": speed.flops_per_s, "prefill_overhead_s": speed.overhead_s}
    # the 7-token tail's compute; a forward call's fixed cost is in the load overhead below
    tail = {n: (prefix_prefill_flops(shape, n + 7, 1) - prefix_prefill_flops(shape, n, 1)) / speed.flops_per_s
            for n in measured["tokens"]}
    for tier in TIERS:
        pred[tier.name] = {n: max(tail[n], n // BLOCK * nbytes / tier.read_bytes_per_s) + tier.read_latency_s
                           for n in measured["tokens"]}
    pred["fresh"] = {n: speed.overhead_s + prefix_prefill_flops(shape, n + 7, 1) / speed.flops_per_s
                     for n in measured["tokens"]}
    # what a load costs beyond its bytes (calls, copies into the engine's layout): the DRAM case's excess
    excess = statistics.median(statistics.median(measured["dram"][n]) - pred["dram"][n] for n in measured["tokens"])
    pred["load_overhead_s"] = max(0.0, excess)
    for tier in TIERS:
        pred[tier.name] = {n: t + pred["load_overhead_s"] for n, t in pred[tier.name].items()}
    pred["break_even"] = {
        "tiny": {t.name: break_even(shape, BLOCK, nbytes, speed.flops_per_s, t, DRAM) for t in TIERS},
        "llama-3-8b": {t.name: break_even(CostShape.llama3_8b(), 16, 2 << 20, 4e14, t, DRAM) for t in TIERS},
    }
    return pred


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench tiering", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="", help="directory for results.json and tiering.png")
    args = parser.parse_args(argv)
    measured = measure([int(x) for x in args.tokens.split(",")], args.runs)
    pred = predict(measured)
    med = {k: {n: statistics.median(v) for n, v in measured[k].items()} for k in ("fresh", "dram", "ssd", "peer")}
    print(f"\nTTFT of a prompt served from each tier vs recomputed, tiny Llama {SHAPE.hidden}x{SHAPE.layers} "
          f"(fp32, CPU), medians of {args.runs}; predicted by the ledger (prefill {pred['flops_per_s']:.3g} FLOP/s "
          f"+ {pred['prefill_overhead_s'] * 1e3:.1f} ms fitted, "
          f"load overhead {pred['load_overhead_s'] * 1e3:.1f} ms)\n")
    print("| tokens | recompute ms (model) | DRAM ms (model) | SSD ms (model) | peer ms (model) |")
    print("|---|---|---|---|---|")
    for n in measured["tokens"]:
        cells = [f"{med[k][n] * 1e3:.1f} ({pred[k][n] * 1e3:.1f})" for k in ("fresh", "dram", "ssd", "peer")]
        print(f"| {n} | {' | '.join(cells)} |")
    print("\nBreak-even block index (prefill of the block > read from the tier + write into memory):\n")
    print("| model | DRAM | SSD | peer |")
    print("|---|---|---|---|")
    for name, row in pred["break_even"].items():
        print(f"| {name} | " + " | ".join("never" if row[t.name] is None else str(row[t.name]) for t in TIERS) + " |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"measured": measured, "median": med, "predicted": pred},
                                                     indent=2, default=str))
        why = render("tiering", out / "results.json", out / "tiering.png")
        print(f"\nchart: {out / 'tiering.png'}" if why is None else f"\nno chart: {why}")
    return 0
