"""Routing evaluation (issue 29): a workload replayed through the real router and index code
over K simulated nodes, each policy on a cluster of its own, compared in one run.

    python -m tools.route_sim [--trace PATH] [--shapes chat,docqa,...] [--nodes 4,8] [--limit N]
                              [--capacity BLOCKS] [--speedup X] [--policies ...] [--json PATH]

Nodes (tools/route_sim/cluster.py): a cache of ``--capacity`` blocks per node under the store's
eviction policy (``credit``), an engine whose prefill takes the cost model's FLOPs (Llama-3-8B
shape) at 3e14 FLOP/s plus 10 ms, with a FIFO queue, a 20 ms first-block decode, 64 MiB blocks of
512 tokens read at 19 GB/s from the node's memory and 5 GB/s from a peer. kvstored's router starts
from a wrong prior (4e14 FLOP/s, no overhead) and learns the speed from the prefills the nodes
report, with each node's backlog reported every 100 ms. Arrivals are the trace's, compressed by
``--speedup`` (default: K / 4, so each node sees the load of the 4-node run).

Reported per policy: mean and p90 TTFT, hit rate (cached tokens over prompt tokens, pulled
blocks included), load imbalance (the busiest node's prefill seconds over the mean).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstored.policy.cost import ModelShape
from kvstored.router.index import GlobalIndex
from kvstored_client.contract.namespace import Namespace
from tools.route_sim.cluster import Cluster, EngineModel, Req
from tools.route_sim.policies import (
    DynamoCost,
    Kvstored,
    LeastLoaded,
    LlmdPrefix,
    Oracle,
    Policy,
    RoundRobin,
    SGLangCacheAware,
)
from tools.trace_replay import DEFAULT_TRACE

BLOCK_TOKENS = 512
POLICY_NAMES = ("round-robin", "least-loaded", "sglang", "dynamo", "llm-d", "kvstored", "oracle")


def load_requests(rows: list[dict[str, Any]], limit: int | None, speedup: float) -> list[Req]:
    """Requests from rows in the conversation trace's format (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids`` of 512-token blocks, the last one maybe partial)."""
    out = []
    for row in rows[:limit]:
        tokens = int(row["input_length"])
        chain = tuple(int(h) for h in row["hash_ids"][:tokens // BLOCK_TOKENS])
        out.append(Req(float(row["timestamp"]) / 1000.0 / speedup, tokens, int(row.get("output_length", 0)), chain))
    out.sort(key=lambda r: r.arrival)
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def make_policy(name: str, cluster: Cluster, index: GlobalIndex, ns: Namespace, seed: int,
                spread: float = 0.05) -> Policy:
    if name == "round-robin":
        return RoundRobin(cluster)
    if name == "least-loaded":
        return LeastLoaded(cluster)
    if name == "sglang":
        return SGLangCacheAware(cluster, tree_blocks=4 * cluster.nodes[0].cache.capacity)
    if name == "dynamo":
        return DynamoCost(cluster, index)
    if name == "llm-d":
        return LlmdPrefix(cluster, index)
    if name == "kvstored":
        return Kvstored(cluster, index, ns, lambda: cluster.now, random.Random(seed), 4.0e14, spread)
    if name == "oracle":
        return Oracle(cluster)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")


def simulate(name: str, reqs: list[Req], k: int, capacity: int, engine: EngineModel, seed: int,
             report_s: float = 0.1, spread: float = 0.05) -> dict[str, Any]:
    ns = Namespace(model="llama-3-8b", block_size=BLOCK_TOKENS)
    cluster = Cluster(k, capacity, "credit", engine, ns.identity())
    index = GlobalIndex()
    policy = make_policy(name, cluster, index, ns, seed, spread)
    names = [n.name for n in cluster.nodes]
    ttfts = np.empty(len(reqs))
    cached = total = 0
    next_report = -1.0
    started = time.perf_counter()
    for j, req in enumerate(reqs):
        now = cluster.now = req.arrival
        for kind, payload in cluster.due(now):
            if kind == "events":
                i, events = payload  # type: ignore[misc]
                index.apply(names[i], events)
            elif isinstance(policy, Kvstored):
                i, r, hit, seconds = payload  # type: ignore[misc]
                policy.calibration.observe(names[i], engine.shape, r.tokens,
                                           min(hit * BLOCK_TOKENS, r.tokens - 1), seconds)
        if isinstance(policy, Kvstored) and now >= next_report:
            policy.report(now)
            next_report = now + report_s
        node, pull = policy.choose(req, now)
        served = cluster.serve(node, req, now, pull)
        if isinstance(policy, DynamoCost):
            policy.started(node, req, served.prefill_end, served.end, len(req.chain) - served.hit_blocks)
        policy.routed(node, req, now)
        ttfts[j] = served.ttft_s
        cached += min((served.hit_blocks + served.pulled_blocks) * BLOCK_TOKENS, req.tokens)
        total += req.tokens
    work = np.array([n.work_s for n in cluster.nodes])
    return {"policy": name, "nodes": k, "requests": len(reqs), "mean_ttft_s": float(ttfts.mean()),
            "p90_ttft_s": float(np.percentile(ttfts, 90)), "hit_rate": cached / max(total, 1),
            "imbalance": float(work.max() / work.mean()) if work.mean() else 1.0,
            "sim_seconds": time.perf_counter() - started}


def table(results: list[dict[str, Any]]) -> str:
    def key(r: dict[str, Any]) -> tuple[str, int]:
        return r.get("workload", ""), r["nodes"]

    dynamo = {key(r): r["mean_ttft_s"] for r in results if r["policy"] == "dynamo"}
    oracle = {key(r): r["mean_ttft_s"] for r in results if r["policy"] == "oracle"}
    lines = ["| workload | K | policy | mean TTFT s | p90 TTFT s | hit rate | imbalance | vs Dynamo | vs oracle |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        vs_d = f"{100 * (r['mean_ttft_s'] / dynamo[key(r)] - 1):+.1f}%" if key(r) in dynamo else "-"
        vs_o = f"{100 * (r['mean_ttft_s'] / oracle[key(r)] - 1):+.1f}%" if key(r) in oracle else "-"
        lines.append(f"| {r.get('workload', '')} | {r['nodes']} | {r['policy']} | {r['mean_ttft_s']:.3f} | "
                     f"{r['p90_ttft_s']:.3f} | {100 * r['hit_rate']:.1f}% | {r['imbalance']:.3f} | {vs_d} | {vs_o} |")
    return "\n".join(lines)


def workloads(args: argparse.Namespace) -> list[tuple[str, list[dict[str, Any]]]]:
    out: list[tuple[str, list[dict[str, Any]]]] = []
    if args.trace != "none":
        out.append(("conversation", read_jsonl(Path(args.trace))))
    if args.shapes:
        try:
            from tools import workloads as gen
        except ImportError:
            raise SystemExit("route_sim: --shapes needs tools/workloads.py (the workload generator)") from None
        for shape in args.shapes.split(","):
            out.append((shape, list(gen.generate(shape, args.shape_requests, args.seed))))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.route_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="conversation trace (JSONL); 'none' to skip")
    parser.add_argument("--shapes", default="", help="workload generator shapes, comma-separated (tools.workloads)")
    parser.add_argument("--shape-requests", type=int, default=3000, help="requests per generated shape")
    parser.add_argument("--nodes", default="4,8", help="cluster sizes K, comma-separated")
    parser.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    parser.add_argument("--capacity", type=int, default=4000, help="blocks each node caches (512 tokens each)")
    parser.add_argument("--speedup", type=float, default=0.0, help="arrival compression (0: K / 4)")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-s", type=float, default=0.1, help="how often nodes report their queue to kvstored")
    parser.add_argument("--spread", type=float, default=0.05, help="kvstored's router.spread")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    shape = ModelShape.llama3_8b()
    engine = EngineModel(shape, BLOCK_TOKENS, BLOCK_TOKENS * shape.kv_bytes_per_token())
    results = []
    for wname, rows in workloads(args):
        for k in (int(x) for x in args.nodes.split(",")):
            reqs = load_requests(rows, args.limit, args.speedup or k / 4)
            for name in args.policies.split(","):
                r = simulate(name, reqs, k, args.capacity, engine, args.seed, args.report_s, args.spread)
                r["workload"] = wname
                results.append(r)
                print(f"{wname} K={k} {name}: mean {r['mean_ttft_s']:.3f} s, p90 {r['p90_ttft_s']:.3f} s, "
                      f"hits {100 * r['hit_rate']:.1f}%, imbalance {r['imbalance']:.3f} "
                      f"({r['sim_seconds']:.1f} s)", file=sys.stderr, flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
