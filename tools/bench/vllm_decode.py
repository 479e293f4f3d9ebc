"""Prefill/decode through real vLLM (CPU) over a slow peer link: the decode engine's TTFT when it
waits for a prompt's whole prefix to arrive, and when it follows the wait rule (``kv_consumer``:
start on the blocks that arrived once the rest would arrive later than the engine computes them).

    python -m tools.bench vllm-decode [--tokens 2048] [--runs 3] [--link-mib-s 2,0] [--hidden 512]
                                      [--layers 4]

Two daemons on loopback, peers of each other: the prefill node's, and the decode node's, which
reaches the prefill node through a relay pacing the blocks it receives to ``--link-mib-s`` MiB/s
(0: unpaced). A producer engine (``kv_role="kv_producer"``) on the prefill node serves every
prompt cold and stores it: its TTFT is the cold prefill. On the decode node,
each run serves a new prompt twice over (two prompts, each new to that node): by an engine that
waits for the whole prefix (``kv_both`` with ``peers``: its load pulls the prompt first), and by
one with the wait rule (``kv_consumer`` with ``peers``; its prefill rate measured from its own
steps, the first a warm-up prompt's cold prefill). TTFT is a one-token ``generate``'s wall time.
Prints medians, the tokens each took from kvstored, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import kvstored
from tools.bench.common import REPO_ROOT
from tools.bench.local_daemon import local_daemon
from tools.bench.paced_link import PacedLink
from tools.bench.vllm_ttft import ENGINE, VENV_PYTHON, EngineProcess

BLOCK = 64   # vllm_engine's block size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_fetched(client: kvstored.Client, at_least: int, timeout_s: float = 60.0) -> None:
    """Until the decode node has fetched ``at_least`` blocks from its peers in all (or, said,
    ``timeout_s`` passed: its lookup of the peers timed out, say, so that nothing was pulled)."""
    deadline = time.monotonic() + timeout_s
    while (fetched := int(client.stats()["peer_fetched_blocks"])) < at_least:
        if time.monotonic() > deadline:
            print(f"the decode node fetched {fetched} blocks in all, not {at_least}, in {timeout_s} s")
            return
        time.sleep(0.05)


def engine_options(max_len: int, role: str, **settings: object) -> list[str]:
    """The engine script's options: its kv_role and more of the connector's settings."""
    return ["--max-len", str(max_len), "--role", role, "--extra", json.dumps(settings)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench vllm-decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--link-mib-s", default="2,0", help="the peer link's rates in MiB/s (0: unpaced)")
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if not VENV_PYTHON.exists():
        print("python -m tools.bench vllm-decode needs vLLM's environment: bash tools/ci/install-vllm.sh")
        return 1
    rates = [float(x) for x in args.link_mib_s.split(",")]
    n, max_len = args.tokens, args.tokens + 256
    blocks = (n - 1) // BLOCK   # what the decode engines take at most: vLLM computes the last token
    tmp = Path(tempfile.mkdtemp(prefix="kvstored-bench-vllm-decode-"))
    rng = random.Random(0)
    prompts = {(rate, run, who): [rng.randrange(3, 1024) for _ in range(n)]
               for rate in rates for run in range(args.runs) for who in ("whole", "rule")}
    port_a, port_b = free_port(), free_port()
    link = PacedLink(("127.0.0.1", port_a))
    # the peer lookup's deadline (1 s by default) lengthened: a loaded machine's relay answers late
    common = ("--dram-capacity", "2GiB", "--log-level", "warning", "--set", "peers.token=bench",
              "--set", "peers.lookup_timeout_s=10")
    try:
        model = tmp / "model"
        subprocess.run([str(VENV_PYTHON), str(ENGINE), "make-model", str(model), "--hidden", str(args.hidden),
                        "--layers", str(args.layers)], check=True, capture_output=True, cwd=REPO_ROOT)
        with local_daemon("--set", f"peers.listen=127.0.0.1:{port_a}", "--set", "peers.node_id=prefill",
                          "--set", f"peers.static=decode=127.0.0.1:{port_b}", *common) as a, \
                local_daemon("--set", f"peers.listen=127.0.0.1:{port_b}", "--set", "peers.node_id=decode",
                             "--set", f"peers.static=prefill=127.0.0.1:{link.port}", *common) as b:
            producer = EngineProcess(model, a.socket, engine_options(max_len, "kv_producer"), tmp / "producer.log")
            try:
                producer.send({"prompt": [rng.randrange(3, 1024) for _ in range(n)]})   # warm up
                cold = [producer.send({"prompt": p})["ttft_s"] for p in prompts.values()]
            finally:
                producer.close()
            whole = EngineProcess(model, b.socket, engine_options(max_len, "kv_both", peers=True, save=False,
                                                                  timeout_s=300), tmp / "whole.log")
            rule = EngineProcess(model, b.socket, engine_options(max_len, "kv_consumer", peers=True, max_wait_s=300),
                                 tmp / "rule.log")
            loads: list[float] = []
            try:
                for engine in (whole, rule):   # warm up on a prompt no node has
                    engine.send({"prompt": [rng.randrange(3, 1024) for _ in range(n)]})
                ttft: dict[tuple[float, str], list[float]] = {}
                cached: dict[tuple[float, str], list[int]] = {}
                for rate in rates:
                    link.bytes_per_s = rate * (1 << 20)
                    for run in range(args.runs):
                        for who, engine in (("whole", whole), ("rule", rule)):
                            fetched = int(b.stats()["peer_fetched_blocks"])
                            answer = engine.send({"prompt": prompts[(rate, run, who)]})
                            ttft.setdefault((rate, who), []).append(answer["ttft_s"])
                            cached.setdefault((rate, who), []).append(answer["cached"])
                            wait_fetched(b, fetched + blocks)   # the rule's pull goes on: let it end
                            loads.append(os.getloadavg()[0])
            finally:
                whole.close()
                rule.close()
        print(f"\nDecode engine TTFT over a paced peer link, {n}-token prompts, random-weight Llama hidden "
              f"{args.hidden} x {args.layers} layers (fp32, blocks of {BLOCK}); medians of {args.runs} runs (ms)")
        print(f"cold prefill (the producer): {statistics.median(cold) * 1e3:.0f} ms ({n / statistics.median(cold):.0f} "
              f"tokens/s); 1-minute load average {min(loads):.1f}-{max(loads):.1f}\n")
        print("| link | cold prefill | waiting for the whole prefix | wait rule (kv_consumer) | rule / whole "
              "| tokens taken (whole) | tokens taken (rule, per run) |")
        print("|---|---|---|---|---|---|---|")
        for rate in rates:
            w, r = (statistics.median(ttft[(rate, who)]) for who in ("whole", "rule"))
            print(f"| {f'{rate:g} MiB/s' if rate else 'unpaced'} | {statistics.median(cold) * 1e3:.0f} "
                  f"| {w * 1e3:.0f} | {r * 1e3:.0f} | {r / w:.2f}x "
                  f"| {statistics.median(cached[(rate, 'whole')])} | {', '.join(map(str, cached[(rate, 'rule')]))} |")
    finally:
        link.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
