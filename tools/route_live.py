"""The router live: three daemons and kvstored-router on loopback, three tiny engines
(tools/tiny_engine.py, a random-weight Llama on CPU whose KV lives in buffers registered with its
node's daemon) serving multi-turn conversations with a shared system prompt.

    python -m tools.route_live [--conversations 5] [--turns 4] [--seed 0]

Each request goes where the router says (or round robin, for comparison: the caches are emptied
between the two runs); the engine on that node loads what its daemon holds, prefills the rest,
saves the new blocks (the daemon's KV events then reach the router) and reports the prefill it
measured to the router (its calibration). Printed per policy: mean and p90 TTFT (measured by the
engine: its load from the daemon and its prefill, up to the first token's logits), the share of
prompt tokens that came from a daemon, and where requests went.
Requests run one at a time, so queues stay empty: this run shows reuse, not load balancing (the
router then rightly keeps a conversation where its history is). With five conversations over three
nodes round robin sends each turn of a conversation to another node than the last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

NODES = ("node-a", "node-b", "node-c")
SYSTEM_TOKENS, TURN_TOKENS = 160, 96


def _wait(predicate: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"route_live: {what} did not happen within {timeout:.0f} s")


class Cluster:
    """Three daemons with events on ipc:// sockets and a router following them."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sockets = {}
        for node in NODES:
            sock = tmp / f"{node}.sock"
            self.sockets[node] = str(sock)
            self._spawn([sys.executable, "-m", "kvstored", "--no-config", "--socket", str(sock),
                         "--dram-capacity", "256MiB", "--set", "dram.page_bytes=4MiB", "--ssd-path",
                         str(tmp / f"{node}-ssd"), "--ssd-capacity", "512MiB", "--set", "events.enabled=true",
                         "--set", f"events.endpoint=ipc://{tmp}/{node}.pub", "--set",
                         f"events.replay_endpoint=ipc://{tmp}/{node}.replay", "--set", f"events.node_id={node}",
                         "--set", "events.heartbeat_s=0.2"], tmp / f"{node}.log")
        for node in NODES:
            _wait(lambda n=node: Path(self.sockets[n]).exists(), f"{node}'s socket")
        self.url = f"http://127.0.0.1:{port}"
        args = [sys.executable, "-m", "kvstored.router.main", "--no-config", "--listen", f"127.0.0.1:{port}",
                # a slow prefill prior: a tiny model on CPU, not an 8B on a GPU; the reports refit it
                "--set", "router.prefill_flops_per_s=1e10", "--set", "router.decode_s=0.0",
                # no pulls: the engines here load from their own daemon only
                "--set", "router.peer_bytes_per_s=1"]
        for node in NODES:
            args += ["--source", f"{node}=ipc://{tmp}/{node}.pub,ipc://{tmp}/{node}.replay"]
        self._spawn(args, tmp / "router.log")
        _wait(lambda: len(self.get("/v1/nodes")["available"]) == len(NODES), "the router's sync with the daemons")

    def _spawn(self, args: list[str], log: Path) -> None:
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                               env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}))

    def post(self, path: str, obj: Any) -> Any:
        req = urllib.request.Request(self.url + path, json.dumps(obj).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.load(resp)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return json.load(resp)

    def close(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def conversations(count: int, turns: int, seed: int) -> list[np.ndarray]:
    """Requests in arrival order: conversations interleaved, each turn's prompt its history plus a
    new turn, all behind one system prompt."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 1000, SYSTEM_TOKENS)
    histories = [system.copy() for _ in range(count)]
    out = []
    for _ in range(turns):
        for c in range(count):
            histories[c] = np.concatenate([histories[c], rng.integers(1, 1000, TURN_TOKENS)])
            out.append(histories[c].copy())
    return out


def run(cluster: Cluster, engines: dict[str, Any], prompts: list[np.ndarray], policy: str) -> dict[str, Any]:
    ttfts, cached, total, went = [], 0, 0, dict.fromkeys(NODES, 0)
    ns = dataclasses.asdict(next(iter(engines.values())).buffers.namespace)
    ns.pop("block_bytes", None)
    for i, prompt in enumerate(prompts):
        if policy == "round robin":
            node = NODES[i % len(NODES)]
        else:
            node = cluster.post("/v1/route", {"namespace": ns, "token_ids": prompt.tolist()})["node"]
        turn = engines[node].run(prompt)
        seconds = turn.ttft_s
        ttfts.append(seconds)
        cached += turn.cached_tokens
        total += len(prompt)
        went[node] += 1
        cluster.post("/v1/report", {"node": node, "queued_prefill_s": 0.0, "prefills": [
            {"model": ns["model"], "tokens": len(prompt), "cached_tokens": turn.cached_tokens, "seconds": seconds}]})
        time.sleep(0.05)   # the saved blocks' events reach the router
    return {"policy": policy, "mean_ttft_s": float(np.mean(ttfts)), "p90_ttft_s": float(np.percentile(ttfts, 90)),
            "hit_rate": cached / total, "requests": went}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.route_live", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="the router's HTTP port (0: a free one)")
    args = parser.parse_args(argv)
    import socket

    import kvstored
    from tools.tiny_engine import Engine

    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="route-live-"))
    cluster = Cluster(tmp, port)
    engines: dict[str, Any] = {}
    results = []
    try:
        blocks = (SYSTEM_TOKENS + args.turns * TURN_TOKENS) // 16 + 1
        engines = {node: Engine(kvstored.Client(cluster.sockets[node]), num_blocks=blocks) for node in NODES}
        prompts = conversations(args.conversations, args.turns, args.seed)
        for policy in ("kvstored router", "round robin"):
            for engine in engines.values():
                engine.client.evict()
            time.sleep(0.5)
            results.append(run(cluster, engines, prompts, policy))
    finally:
        for engine in engines.values():
            engine.close()
            engine.client.close()
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print("| policy | mean TTFT ms | p90 TTFT ms | tokens from a daemon | requests per node |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['mean_ttft_s'] * 1e3:.1f} | {r['p90_ttft_s'] * 1e3:.1f} | "
              f"{100 * r['hit_rate']:.1f}% | {', '.join(f'{n} {c}' for n, c in r['requests'].items())} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
