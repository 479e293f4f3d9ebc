"""The seed's migration scenario, made into numbers: a prefill node hands a prompt's KV to a decode
node, and the decode node either waits for the whole prefix after the prefill or receives the
blocks while the prefill is still running (first-block pipelining). Measured next to the ledger's
prediction (``kvstored.policy.migration``), at 4k, 32k and 128k tokens.

    python -m tools.bench migration [--tokens 4096,32768,131072] [--runs 3] [--out DIR]

Two daemons on loopback, peers of each other: A (prefill) and B (decode). A's engine holds the
prompt's KV in buffers registered with A and "prefills" it chunk by chunk (``--chunk`` blocks of
16 tokens), each chunk taking what the cost model says it costs (``--model`` at ``--flops``
FLOP/s: attention makes later chunks dearer) and saved with ``save_blocks`` as it is done. Then:

* whole prefix: B pulls the prompt from A after the prefill (``Client.pull``);
* pipelined: each chunk is saved with ``push_to`` B, so its blocks cross while the next chunk is
  computed; B's engine polls ``lookup`` until it holds the last block.

"KV ready" is from the prefill's start to B holding every block; TTFT adds the first token's
decode (``--decode-ms``, not run here: the same for both). The prediction (the ledger: ``TTFT =
queue + max(prefill, wait for KV) + first-block decode``, with the wait of a pipelined transfer
simulated chunk by chunk) uses the peer link's rate and fixed cost measured by two pulls before the
runs, as a daemon measures its peer links. The KV bytes per block are ``--block-bytes`` (the
prefill's cost is the model's), so a large model's prompt need not fit this machine's memory.
Writes ``results.json`` and ``migration.png`` (when matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import kvstored
from kvstored import Namespace
from kvstored.config import parse_size
from kvstored.policy.cost import DEFAULT_PREFILL_FLOPS_PER_S, shape_for
from kvstored.policy.migration import Link, chunk_ends, kv_ready_pipelined, kv_ready_whole, prefill_schedule
from tools.bench.chart import render
from tools.bench.common import free_port
from tools.bench.local_daemon import local_daemon

BLOCK_TOKENS = 16
POLL_S = 0.001
READY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0


def _chain(blocks: int, seed: int) -> list[bytes]:
    return [np.random.default_rng(seed * 1_000_003 + i).bytes(32) for i in range(blocks)]


class Pair:
    """Daemons A (prefill, with the engine's buffers) and B (decode), peers of each other."""

    def __init__(self, a: kvstored.Client, b: kvstored.Client, blocks: int, block_bytes: int) -> None:
        # a 128k-token prompt's chunk saves and pulls take seconds on a loaded machine: not the SDK's 30 s default
        self.a = kvstored.Client(a.socket, timeout_s=CALL_TIMEOUT_S)
        self.b = kvstored.Client(b.socket, timeout_s=CALL_TIMEOUT_S)
        self.engine = kvstored.shm.empty((blocks, block_bytes), "uint8")
        self.engine.numpy()[:] = np.random.default_rng(5).integers(0, 255, size=(blocks, block_bytes),
                                                                    dtype=np.uint8)
        self.buffers = self.a.register_buffers([self.engine.numpy()], 0,
                                          namespace=Namespace(model="bench-migration", block_bytes=block_bytes))
        self.ns = self.buffers.namespace

    def close(self) -> None:
        self.a.unregister_buffers(self.buffers)
        self.a.close()
        self.b.close()

    def reset(self) -> None:
        self.a.evict()
        self.b.evict()

    def prefill(self, chain: list[bytes], chunk: int, schedule: list[float], push: bool) -> float:
        """Save the chain chunk by chunk at the schedule's times (pushing each to B when ``push``);
        returns the prefill's start on ``time.perf_counter``."""
        start = time.perf_counter()
        for at, end in zip(schedule, chunk_ends(len(chain), chunk)):
            wait = start + at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            res = self.a.save_blocks(self.buffers, list(range(end)), hashes=chain[:end], push_to="b" if push else "")
            assert res.present + res.stored == end, res
        return start

    def pull(self, chain: list[bytes]) -> None:
        out = self.b.pull(hashes=chain, namespace=self.ns)
        assert out.complete, out

    def wait_held(self, chain: list[bytes]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.b.lookup(hashes=chain, namespace=self.ns).blocks < len(chain):
            if time.monotonic() > deadline:
                raise TimeoutError(f"B never held the {len(chain)} pushed blocks")
            time.sleep(POLL_S)


def calibrate(pair: Pair, blocks: int, block_bytes: int, chunk: int) -> Link:
    """The peer link from two pulls (``blocks // 8`` and ``blocks`` blocks, medians of three) of
    chains saved as the runs save theirs (``chunk`` blocks a call, unpaced): the slope is the
    rate, the rest the fixed cost."""
    sizes = (max(1, blocks // 8), blocks)
    took: dict[int, float] = {}
    for n in sizes:
        runs = []
        for i in range(4):
            pair.reset()
            chain = _chain(n, 7_000 + 10 * n + i)
            pair.prefill(chain, chunk, [0.0] * len(chunk_ends(n, chunk)), push=False)
            t0 = time.perf_counter()
            pair.pull(chain)
            if i:   # the first one warms up
                runs.append(time.perf_counter() - t0)
        took[n] = statistics.median(runs)
    small, large = sizes
    rate = (large - small) * block_bytes / max(took[large] - took[small], 1e-9)
    return Link(max(0.0, took[small] - small * block_bytes / rate), rate)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shape = shape_for(args.model)
    largest = max(args.tokens) // BLOCK_TOKENS
    bb = args.block_bytes
    dram = -(-(largest * bb * 3 // 2 + (128 << 20)) // (32 << 20)) * (32 << 20)
    pa, pb = free_port(), free_port()
    static = f"a=127.0.0.1:{pa},b=127.0.0.1:{pb}"
    common = ("--dram-capacity", str(dram), "--set", "dram.page_bytes=32MiB", "--set", "ssd.enabled=false",
              "--log-level", "warning", "--set", "peers.token=bench", "--set", f"peers.static={static}")
    out: dict[str, Any] = {"model": args.model, "flops_per_s": args.flops, "block_bytes": bb, "chunk": args.chunk,
                           "decode_s": args.decode_ms / 1e3, "runs": args.runs, "tokens": args.tokens,
                           "prefill_s": {}, "whole_s": {}, "pipelined_s": {}}
    with local_daemon(*common, "--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a") as a, \
            local_daemon(*common, "--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b") as b:
        pair = Pair(a, b, largest, bb)
        try:
            link = calibrate(pair, min(largest, 2048), bb, args.chunk)
            out["link"] = {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s}
            print(f"peer link: {link.bytes_per_s / 1e9:.2f} GB/s, {link.latency_s * 1e3:.2f} ms a transfer",
                  file=sys.stderr)
            for tokens in args.tokens:
                n = tokens // BLOCK_TOKENS
                schedule = prefill_schedule(shape, n, BLOCK_TOKENS, args.chunk, args.flops)
                out["prefill_s"][tokens] = schedule[-1]
                whole, piped = [], []
                for run in range(args.runs):
                    for push, into in ((False, whole), (True, piped)):
                        pair.reset()
                        chain = _chain(n, tokens * 100 + run * 2 + push)
                        start = pair.prefill(chain, args.chunk, schedule, push)
                        if push:
                            pair.wait_held(chain)
                        else:
                            pair.pull(chain)
                        into.append(time.perf_counter() - start)
                out["whole_s"][tokens], out["pipelined_s"][tokens] = whole, piped
                print(f"{tokens} tokens: prefill {schedule[-1] * 1e3:.0f} ms, KV ready whole "
                      f"{statistics.median(whole) * 1e3:.0f} ms, pipelined {statistics.median(piped) * 1e3:.0f} ms",
                      file=sys.stderr)
            pair.reset()
        finally:
            pair.close()
    return out


def predicted(results: dict[str, Any]) -> dict[str, dict[int, float]]:
    shape = shape_for(results["model"])
    link = Link(results["link"]["latency_s"], results["link"]["bytes_per_s"])
    pred: dict[str, dict[int, float]] = {"whole_s": {}, "pipelined_s": {}}
    for tokens in results["tokens"]:
        n = tokens // BLOCK_TOKENS
        schedule = prefill_schedule(shape, n, BLOCK_TOKENS, results["chunk"], results["flops_per_s"])
        pred["whole_s"][tokens] = kv_ready_whole(schedule, n, results["block_bytes"], link)
        pred["pipelined_s"][tokens] = kv_ready_pipelined(schedule, n, results["chunk"], results["block_bytes"], link)
    return pred


def report(results: dict[str, Any]) -> None:
    pred = results["predicted"]
    decode = results["decode_s"]
    print(f"\nPrefill on A ({results['model']} at {results['flops_per_s']:.3g} FLOP/s, chunks of "
          f"{results['chunk']} blocks), the KV handed to B: 16-token blocks of {results['block_bytes'] >> 10} KiB, "
          f"medians of {results['runs']}; TTFT = KV ready + {decode * 1e3:.0f} ms first-token decode; "
          f"the model's prediction in brackets\n")
    print("| tokens | prefill ms | whole prefix: TTFT ms | pipelined: TTFT ms | wait after prefill, whole / "
          "pipelined ms | pipelined / whole |")
    print("|---|---|---|---|---|---|")
    for tokens in results["tokens"]:
        pre = results["prefill_s"][tokens]
        whole = statistics.median(results["whole_s"][tokens])
        piped = statistics.median(results["pipelined_s"][tokens])
        whole_model, piped_model = pred["whole_s"][tokens] + decode, pred["pipelined_s"][tokens] + decode
        print(f"| {tokens} | {pre * 1e3:.0f} | {(whole + decode) * 1e3:.0f} ({whole_model * 1e3:.0f}) | "
              f"{(piped + decode) * 1e3:.0f} ({piped_model * 1e3:.0f}) | "
              f"{(whole - pre) * 1e3:.1f} / {(piped - pre) * 1e3:.1f} | {(piped + decode) / (whole + decode):.2f}x |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench migration",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--tokens", default="4096,32768,131072", help="prompt lengths, comma-separated")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", default="llama-3-8b", help="the prefill's cost: a model the cost model knows")
    p.add_argument("--flops", type=float, default=DEFAULT_PREFILL_FLOPS_PER_S, help="prefill FLOP/s")
    p.add_argument("--block-bytes", type=parse_size, default=128 << 10, help="KV bytes of a 16-token block")
    p.add_argument("--chunk", type=int, default=64, help="blocks per prefill chunk")
    p.add_argument("--decode-ms", type=float, default=20.0, help="the first token's decode")
    p.add_argument("--out", help="directory for results.json and migration.png")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if min(args.tokens) < BLOCK_TOKENS or args.runs < 1 or args.chunk < 1 or args.flops <= 0:
        p.error("every prompt needs a whole block; --runs, --chunk and --flops must be positive")
    results = measure(args)
    results["predicted"] = predicted(results)
    report(results)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        why = render("migration", out / "results.json", out / "migration.png")
        print(f"\nresults: {out / 'results.json'}; " + (f"chart: {out / 'migration.png'}" if why is None
                                                      else f"no chart: {why}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
