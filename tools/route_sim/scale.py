"""Scale figures of the router's index and routing (issue 29, "Scale"):

    python -m tools.route_sim.scale [--entries 1000000] [--nodes 16] [--runs 200]

- events ingested per second on one core: msgpack batches decoded and applied to the global
  index, as the subscriber does (one block per event, the worst case; and 16-block chains);
- index bytes per (block, node) entry at ``--entries`` entries over ``--nodes`` nodes (each
  block on one to three nodes), the table's arrays and the process's RSS growth;
- routing a 32k-token prompt (2,048 blocks of 16 tokens) over ``--nodes`` nodes: p50 and p99,
  by block hashes and by token ids (which the router hashes, sha256_cbor).
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time

import numpy as np

from kvstored.events.wire import Batch, BlockRemoved, BlockStored, decode_batch, encode_batch
from kvstored.policy.routing import NodeCosts
from kvstored.router.calibration import Calibration
from kvstored.router.index import GlobalIndex
from kvstored.router.load import LoadBoard
from kvstored.router.reports import NodeReports
from kvstored.router.router import Defaults, RouteQuery, Router
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def ingest(per_event: int, events: int, batch: int = 64, burst: int = 16) -> float:
    """Events per second through decode + apply, ``per_event`` hashes each, ``batch`` events a
    batch, applied ``burst`` batches at a time."""
    rng = random.Random(1)
    payloads = []
    for _ in range(events // batch):
        evs: list[BlockStored | BlockRemoved] = []
        for _ in range(batch):
            hashes = tuple(rng.getrandbits(64) for _ in range(per_event))
            if rng.random() < 0.2:
                evs.append(BlockRemoved(hashes, "CPU", namespace_id=7))
            else:
                evs.append(BlockStored(hashes, None, 16, rng.choice(("CPU", "DISK")), namespace_id=7))
        payloads.append(encode_batch(Batch(0.0, tuple(evs))))
    index = GlobalIndex()
    start = time.process_time()
    for i in range(0, len(payloads), burst):   # as the subscriber applies a burst of frames at once
        index.apply(f"n{i % 16}", [e for p in payloads[i:i + burst] for e in decode_batch(p).events])
    return (len(payloads) * batch) / (time.process_time() - start)


def memory(entries: int, nodes: int) -> tuple[float, float, int]:
    """(table bytes per entry, RSS growth per entry, entries) after filling the index."""
    rng = np.random.default_rng(2)
    before = _rss_bytes()
    index = GlobalIndex()
    made = 0
    while made < entries:
        keys = rng.integers(1, 2**63, 50_000, dtype=np.int64).astype(np.uint64)
        for copy in range(int(rng.integers(1, 4))):
            node = f"n{(made + copy) % nodes}"
            index.apply(node, [BlockStored(tuple(keys.tolist()), None, 16, "CPU", namespace_id=7)])
            made += len(keys)
    n = index.entries()
    return index.nbytes / n, (_rss_bytes() - before) / n, n


def routing(nodes: int, runs: int) -> tuple[float, float, float, float]:
    """p50 and p99 seconds of a 32k-token route by hashes, then by token ids."""
    ns = Namespace(model="llama-3-8b")
    index = GlobalIndex()
    rng = random.Random(3)
    prompt = [rng.randrange(32000) for _ in range(32768)]
    chain = [int.from_bytes(h[-8:], "big") for h in block_hashes(prompt, 16)]
    for i in range(nodes):
        held = chain[: rng.randrange(len(chain))]
        index.apply(f"n{i}", [BlockStored(tuple(held), None, 16, "CPU", namespace_id=ns.identity())])
        noise = [rng.getrandbits(64) for _ in range(50_000)]
        index.apply(f"n{i}", [BlockStored(tuple(noise), None, 16, "DISK", namespace_id=ns.identity())])
    names = [f"n{i}" for i in range(nodes)]
    router = Router(index, LoadBoard(time.monotonic), Calibration(4e14), NodeReports(), lambda: names,
                    random.Random(0), Defaults(NodeCosts(queue_s=0.0, prefill_flops_per_s=4e14)))

    def timed(query: RouteQuery) -> tuple[float, float]:
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            router.route(query, record=False)
            times.append(time.perf_counter() - t)
        return float(np.percentile(times, 50)), float(np.percentile(times, 99))

    by_hash = timed(RouteQuery(ns, block_hashes=chain, tokens=len(prompt)))
    by_tokens = timed(RouteQuery(ns, token_ids=prompt))
    return (*by_hash, *by_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.route_sim.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--events", type=int, default=200_000, help="events ingested for the rate")
    args = parser.parse_args(argv)
    one = ingest(1, args.events)
    chains = ingest(16, args.events // 5)
    print(f"ingest, 1 block per event: {one:,.0f} events/s on one core")
    print(f"ingest, 16-block chains: {chains:,.0f} events/s ({16 * chains:,.0f} blocks/s) on one core")
    table, rss, n = memory(args.entries, args.nodes)
    print(f"index memory: {table:.1f} B per (block, node) entry in the table, {rss:.1f} B of RSS growth "
          f"({n:,} entries over {args.nodes} nodes)")
    p50, p99, t50, t99 = routing(args.nodes, args.runs)
    print(f"route a 32k-token prompt over {args.nodes} nodes: by hashes p50 {p50 * 1e3:.3f} ms, "
          f"p99 {p99 * 1e3:.3f} ms; by token ids p50 {t50 * 1e3:.3f} ms, p99 {t99 * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
