"""Two kvstored daemons on loopback: block shipping throughput, and time to first vs last block.

Part 1, throughput of 2 MiB blocks (``--run-bytes`` per run), runs interleaved so noise hits all
paths alike (each round starts at a different path), in this one run:

* raw TCP (the ceiling): a sender process ``sendall``s the run's distinct blocks (as many as
  kvstored ships, out of as much memory), this process ``recv_into``s block ``i`` into slot ``i`` of
  a pre-touched region (as B lands blocks in its arena); and, as earlier runs measured it,
  32 blocks (64 MiB) sent over and over into one reused buffer, which keeps more of the bytes
  in cache on both ends (the "cycled" row);
* kvstored pull: daemon B brings a chain that only daemon A holds (``Client.pull``): A serves from
  its arena, B receives straight into arena slots, checksums each block as it lands, seals it;
* kvstored pull (stream): the same through ``Client.stream(...).wait()``, which also reports each
  block to the client as it lands;
* kvstored push: A migrates the namespace to B (``Client.migrate``), B evicts between runs;
* Mooncake Transfer Engine over TCP moving the same blocks, from and into regions of the run's
  size, and (cycled) of 32 blocks (when ``.bench/venv`` has it).

Part 2, pipelined load: prompts of 4k, 32k and 128k tokens (16-token blocks of ``--ttfb-block-bytes``)
saved on A; B's engine streams them into its registered buffers. Time to first block (the first
``BlockArrival``) against time to last block, median over ``--runs``; with ``--out DIR`` also
``results.json`` and the chart of the two (:mod:`tools.bench.chart`'s ``first-last``).

    .venv/bin/python -m tools.bench cluster [--runs 5] [--run-bytes 512MiB] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kvstored
from kvstored import Namespace
from kvstored.config import parse_size
from tools.bench import chart, peerenv, rawtcp
from tools.bench.common import REPO_ROOT, free_port, stop_sender
from tools.bench.mooncake_te import MooncakeError, MooncakeReceiver

PROMPTS = (4096, 32768, 131072)
CYCLED_BLOCKS = 32
RAW = "raw TCP (the run's blocks)"
RAW_CYCLED = f"raw TCP ({CYCLED_BLOCKS} blocks cycled)"
MOONCAKE = "Mooncake TE tcp (the run's blocks)"
MOONCAKE_CYCLED = f"Mooncake TE tcp ({CYCLED_BLOCKS} blocks cycled)"
KVSTORED = ("kvstored pull (Client.pull)", "kvstored pull (stream)", "kvstored push (migrate)")


class Node:
    """A daemon with a peer channel, in a subprocess, and a client to it."""

    def __init__(self, name: str, port: int, static: str, dram: int, tmp: Path) -> None:
        self.socket = str(tmp / f"{name}.sock")
        self.log = open(tmp / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstored", "--no-config", "--socket", self.socket, "--dram-capacity", str(dram),
             "--set", "ssd.enabled=false", "--set", "dram.page_bytes=32MiB",
             "--set", f"peers.listen=127.0.0.1:{port}", "--set", f"peers.node_id={name}",
             "--set", f"peers.static={static}", "--set", "peers.token=bench", "--set", "peers.deadline_s=120",
             "--set", "log.level=warning"], stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client = kvstored.Client(self.socket, timeout_s=300)
                break
            except kvstored.DaemonNotRunning:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"daemon {name} did not start; see {tmp / (name + '.log')}") from None
                time.sleep(0.2)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def keys(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(32) for _ in range(n)]


def save_chain(node: Node, ns: Namespace, chain: list[bytes], block_bytes: int) -> None:
    """Fill A with ``chain`` in batches (distinct bytes per block, every page touched)."""
    step = max(1, (64 << 20) // block_bytes)
    rng = np.random.default_rng(1)
    for i in range(0, len(chain), step):
        part = chain[: i + step]
        rows = rng.integers(0, 255, size=(min(step, len(chain) - i), block_bytes), dtype=np.uint8)
        full = np.empty((len(part), block_bytes), dtype=np.uint8)
        full[i:] = rows
        saved = node.client.save(None, full, hashes=part, namespace=ns)
        assert saved.present + saved.stored == len(part), f"A stored only {saved.present + saved.stored} blocks"


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def throughput(args: argparse.Namespace, a: Node, b: Node) -> dict[str, list[float]]:
    bb = args.block_bytes
    nblocks = max(1, args.run_bytes // bb)
    ns = Namespace(model="bench-ship", block_bytes=bb)
    chain = keys(nblocks, 7)
    save_chain(a, ns, chain, bb)
    rates: dict[str, list[float]] = {RAW: [], RAW_CYCLED: [], "kvstored pull (Client.pull)": [],
                                     "kvstored pull (stream)": [], "kvstored push (migrate)": []}
    # The limits move what kvstored moves: the run's distinct blocks, out of memory as cold as A's
    # arena and into memory as cold as B's. The cycled rows (32 blocks, 64 MiB, sent over and
    # over into one buffer on the raw receiver) are how earlier runs measured them.
    raw_proc, raw_port = rawtcp.start(nblocks, bb)
    raw = rawtcp.RawReceiver(raw_port, bb, slots=nblocks)
    cycled_proc, cycled_port = rawtcp.start(CYCLED_BLOCKS, bb)
    cycled = rawtcp.RawReceiver(cycled_port, bb)
    mooncakes: list[tuple[str, MooncakeReceiver]] = []
    if not args.no_mooncake:
        try:
            for name, count in ((MOONCAKE, nblocks), (MOONCAKE_CYCLED, CYCLED_BLOCKS)):
                mooncakes.append((name, MooncakeReceiver(str(peerenv.PY), count, bb)))
                rates[name] = []
        except MooncakeError as exc:
            print(f"Mooncake left out: {exc}", file=sys.stderr)

    current = [chain]
    fresh_seed = iter(range(1000, 10**9))

    def shipped(move: Callable[[], bool]) -> Callable[[], float]:
        """B starts empty and A holds a chain it has never served (outside the timing: A keeps a
        block's xxh3 once it served it, so shipping one chain over and over left the sender's
        checksum out of every timed run); ``move`` ships it (True once all of it is on B); bytes/s."""
        def run() -> float:
            b.client.evict()
            a.client.evict()
            current[0] = keys(nblocks, next(fresh_seed))
            save_chain(a, ns, current[0], bb)
            t0 = time.perf_counter()
            assert move(), "the chain did not arrive whole"
            return nblocks * bb / (time.perf_counter() - t0)
        return run

    pull = shipped(lambda: b.client.pull(hashes=current[0], namespace=ns).complete)
    stream = shipped(lambda: b.client.stream(hashes=current[0], namespace=ns).wait().complete)
    push = shipped(lambda: list(a.client.migrate("b", model=ns.model))[-1]["pushed_blocks"] == nblocks)

    paths: list[tuple[str, Callable[[], float]]] = [
        (RAW, lambda: raw.run(nblocks, bb)), (RAW_CYCLED, lambda: cycled.run(nblocks, bb)),
        ("kvstored pull (Client.pull)", pull), ("kvstored pull (stream)", stream), ("kvstored push (migrate)", push)]
    for name, receiver in mooncakes:
        paths.append((name, functools.partial(receiver.run, nblocks, "batch")))
    try:
        for _, run in paths:   # warm-up, not counted
            run()
        for i in range(args.runs):
            print(f"throughput run {i + 1}/{args.runs}", file=sys.stderr)
            # each run starts at a different path, so no path always follows the same one
            for name, run in paths[i % len(paths):] + paths[:i % len(paths)]:
                rates[name].append(run())
    finally:
        for limit, proc in ((raw, raw_proc), (cycled, cycled_proc)):
            limit.close()
            stop_sender(proc)
        for _, mooncake in mooncakes:
            mooncake.close()
    b.client.evict()
    a.client.evict()
    return rates


def first_last(args: argparse.Namespace, a: Node, b: Node) -> dict[int, tuple[list[float], list[float]]]:
    bb = args.ttfb_block_bytes
    ns = Namespace(model="bench-pd", block_bytes=bb)
    out: dict[int, tuple[list[float], list[float]]] = {}
    largest = max(PROMPTS) // 16
    engine = kvstored.shm.empty((largest, bb), "uint8")
    buffers = b.client.register_buffers([engine.numpy()], 0, namespace=ns)
    try:
        for tokens in PROMPTS:
            n = tokens // 16
            firsts, lasts = [], []
            for i in range(args.runs + 1):
                # a chain A has never served, saved outside the timing: A keeps a block's xxh3 once
                # it served it, and a prefill node ships each block once
                a.client.evict()
                b.client.evict()
                chain = keys(n, tokens * 1000 + i)
                save_chain(a, buffers.namespace, chain, bb)
                t0 = time.perf_counter()
                stream = b.client.stream(hashes=chain, buffers=buffers, block_ids=list(range(n)))
                first = last = 0.0
                for arrival in stream:
                    now = time.perf_counter() - t0
                    if arrival.index == 0:
                        first = now
                    last = now
                assert stream.outcome is not None and stream.outcome.complete, stream.outcome
                if i:   # the first run warms up
                    firsts.append(first)
                    lasts.append(last)
            out[tokens] = (firsts, lasts)
            print(f"{tokens} tokens: first {med(firsts) * 1e3:.1f} ms, last {med(lasts) * 1e3:.1f} ms",
                  file=sys.stderr)
            a.client.evict()
            b.client.evict()
    finally:
        b.client.unregister_buffers(buffers)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench cluster",
                                     description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--block-bytes", type=parse_size, default=2 << 20)
    parser.add_argument("--run-bytes", type=parse_size, default=512 << 20)
    parser.add_argument("--ttfb-block-bytes", type=parse_size, default=128 << 10)
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-ttfb", action="store_true")
    parser.add_argument("--out", help="directory for results.json and chart.png")
    args = parser.parse_args(argv)
    if args.runs < 5:
        parser.error("--runs must be at least 5 (medians)")
    dram = max(args.run_bytes + (128 << 20), max(PROMPTS) // 16 * args.ttfb_block_bytes + (256 << 20))
    dram = -(-dram // (32 << 20)) * (32 << 20)
    pa, pb = free_port(), free_port()
    static = f"a=127.0.0.1:{pa},b=127.0.0.1:{pb}"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvstored-cluster-") as tmp:
        a = Node("a", pa, static, dram, Path(tmp))
        b = Node("b", pb, static, dram, Path(tmp))
        try:
            if not args.skip_throughput:
                results["throughput"] = throughput(args, a, b)
            if not args.skip_ttfb:
                results["ttfb"] = first_last(args, a, b)
        finally:
            a.close()
            b.close()
    print(f"\nTwo kvstored daemons on loopback, {os.cpu_count()} CPUs, medians over {args.runs} runs\n")
    if "throughput" in results:
        rates = results["throughput"]
        raw, cycled = med(rates[RAW]), med(rates[RAW_CYCLED])
        print(f"Block shipping, {args.block_bytes >> 20} MiB blocks, {args.run_bytes >> 20} MiB per run\n")
        print("| path | median GB/s | min | max | vs raw TCP (the run's blocks) | vs raw TCP (cycled) |")
        print("|---|---|---|---|---|---|")
        for name, values in rates.items():
            print(f"| {name} | {med(values) / 1e9:.2f} | {min(values) / 1e9:.2f} | {max(values) / 1e9:.2f} | "
                  f"{med(values) / raw:.2f}x | {med(values) / cycled:.2f}x |")
        for mc_name in (MOONCAKE, MOONCAKE_CYCLED):
            if mc_name in rates:
                mc = med(rates[mc_name])
                print(f"\nkvstored / {mc_name}: " + ", ".join(
                    f"{name.split(' ', 1)[1]} {med(rates[name]) / mc:.2f}x" for name in KVSTORED))
    if "ttfb" in results:
        ttfb = results["ttfb"]
        print(f"\nPipelined load into engine buffers, 16-token blocks of {args.ttfb_block_bytes >> 10} KiB\n")
        print("| prompt | blocks | bytes | first block ms | last block ms | last / first |")
        print("|---|---|---|---|---|---|")
        for tokens, (firsts, lasts) in sorted(ttfb.items()):
            n = tokens // 16
            print(f"| {tokens // 1024}k | {n} | {n * args.ttfb_block_bytes >> 20} MiB | {med(firsts) * 1e3:.2f} | "
                  f"{med(lasts) * 1e3:.1f} | {med(lasts) / med(firsts):.0f}x |")
        f = [med(ttfb[t][0]) for t in sorted(ttfb)]
        print(f"\nfirst block, largest / smallest prompt: {f[-1] / f[0]:.2f}x (target: within 2x)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"runs": args.runs, "block_bytes": args.block_bytes, "run_bytes": args.run_bytes,
                "ttfb_block_bytes": args.ttfb_block_bytes, "throughput_bytes_s": results.get("throughput", {}),
                "ttfb": {str(t): {"first_s": f, "last_s": last} for t, (f, last) in results.get("ttfb", {}).items()}}
        (out / "results.json").write_text(json.dumps(data, indent=2))
        print(f"\nresults: {out / 'results.json'}")
        if "ttfb" in results:
            why = chart.render("first-last", out / "results.json", out / "chart.png")
            print(f"chart: {out / 'chart.png'}" if why is None else f"no chart: {why}")
    return 0

