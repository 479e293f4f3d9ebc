"""Workloads 2-4 against a running kvstored (product venv): prefix reuse, trace replay, small calls.

``python -m tools.bench.reuse prefix|trace|smallcall --socket S --out result.json ...``
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench.common import percentile, summary, worker_output

BLOCK = 16


def _lat_stats(samples_by_run: list[list[float]]) -> dict[str, Any]:
    """Per-run p50 and p99 in microseconds, summarised over runs."""
    p50 = [percentile(s, 50) * 1e6 for s in samples_by_run if s]
    p99 = [percentile(s, 99) * 1e6 for s in samples_by_run if s]
    return {"p50_us": summary(p50), "p99_us": summary(p99), "samples": sum(len(s) for s in samples_by_run)}


# -- workload 2: prefix reuse ------------------------------------------------------------------
def prefix(a: argparse.Namespace) -> dict[str, Any]:
    import kvstored

    c = kvstored.Client(a.socket)
    try:
        prompt_blocks = a.prompt_tokens // BLOCK
        suffix_tokens = a.suffix_tokens
        system_tokens = a.prompt_tokens - suffix_tokens
        kv = np.zeros((prompt_blocks, a.payload), dtype=np.uint8)
        cold: list[list[float]] = []
        warm: list[list[float]] = []
        by_hash: list[list[float]] = []
        hashing: list[list[float]] = []
        served = total = 0
        for run in range(a.runs + 1):  # run 0 warms up
            rng = np.random.default_rng(1000 + run)
            ns = kvstored.Namespace(model=f"bench-prefix-{run}")
            system = rng.integers(0, 128_000, system_tokens, dtype=np.uint32)
            c_run, w_run, h_run, hash_run = [], [], [], []
            tokens = system
            for _ in range(a.requests):
                tokens = np.concatenate([system, rng.integers(0, 128_000, suffix_tokens, dtype=np.uint32)])
                t0 = time.perf_counter()
                hit = c.lookup(tokens, namespace=ns)
                c_run.append(time.perf_counter() - t0)
                if run:
                    served += hit.tokens
                    total += len(tokens)
                c.save(tokens, kv, namespace=ns)
            hashes = kvstored.block_hashes(tokens)
            for _ in range(a.samples):
                t0 = time.perf_counter()
                r = c.lookup(tokens, namespace=ns)
                w_run.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.lookup(hashes=hashes, namespace=ns)
                h_run.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                kvstored.block_hashes(tokens)
                hash_run.append(time.perf_counter() - t0)
            if r.blocks != prompt_blocks:
                raise AssertionError(f"warm lookup hit {r.blocks} of {prompt_blocks} blocks")
            if run:
                cold.append(c_run)
                warm.append(w_run)
                by_hash.append(h_run)
                hashing.append(hash_run)
        return {"prompt_tokens": a.prompt_tokens, "prompt_blocks": prompt_blocks,
                "system_tokens": system_tokens, "requests_per_run": a.requests, "runs": a.runs,
                "cold": _lat_stats(cold), "warm": _lat_stats(warm), "by_hash": _lat_stats(by_hash),
                "hash_only": _lat_stats(hashing), "served_tokens": served, "total_tokens": total}
    finally:
        c.close()


# -- workload 3: trace replay ------------------------------------------------------------------
def read_window(path: Path, window_s: float, max_requests: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    first = None
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            req = json.loads(line)
            first = req["timestamp"] if first is None else first
            if req["timestamp"] - first > window_s * 1000 or len(out) >= max_requests:
                break
            out.append(req)
    return out


def ideal_hits(requests: list[dict[str, Any]], id_tokens: int) -> int:
    """Tokens an infinite cache with ``BLOCK``-token blocks serves (prefix reuse only)."""
    seen: set[int] = set()
    hits = 0
    for req in requests:
        n = 0
        for h in req["hash_ids"]:
            if h not in seen:
                break
            n += 1
        hits += min(n * id_tokens, req["input_length"]) // BLOCK * BLOCK
        seen.update(req["hash_ids"])
    return hits


def trace(a: argparse.Namespace) -> dict[str, Any]:
    import kvstored

    requests = read_window(Path(a.trace), a.window_s, a.max_requests)
    if not requests:
        raise ValueError(f"no requests in the first {a.window_s:g} s of {a.trace}")
    id_tokens = 512
    cache: dict[int, np.ndarray] = {}

    def tokens_of(req: dict[str, Any]) -> np.ndarray:
        parts = []
        for h in req["hash_ids"]:
            t = cache.get(h)
            if t is None:
                t = cache[h] = np.random.default_rng(h).integers(0, 128_000, id_tokens, dtype=np.uint32)
            parts.append(t)
        return np.concatenate(parts)[: req["input_length"]]

    prompts = [tokens_of(r) for r in requests]  # token generation is not what we measure
    max_blocks = max(len(p) // BLOCK for p in prompts)
    kv = np.zeros((max_blocks, a.payload), dtype=np.uint8)
    c = kvstored.Client(a.socket)
    runs: dict[str, list[float]] = {"req_per_s": [], "blocks_stored_per_s": [], "stored_mb_per_s": [],
                                    "lookup_p50_us": [], "save_p50_us": []}
    hit_tokens = stored_blocks = 0
    try:
        for run in range(a.runs):
            ns = kvstored.Namespace(model=f"bench-trace-{run}-{time.time_ns()}")
            hit_tokens = stored_blocks = 0
            look, save = [], []
            t_start = time.perf_counter()
            for toks in prompts:
                t0 = time.perf_counter()
                hashes = kvstored.block_hashes(toks)
                r = c.lookup(hashes=hashes, namespace=ns)
                t1 = time.perf_counter()
                s = c.save(None, kv[: len(hashes)], hashes=hashes, namespace=ns)
                t2 = time.perf_counter()
                look.append(t1 - t0)
                save.append(t2 - t1)
                hit_tokens += r.tokens
                stored_blocks += s.stored
            elapsed = time.perf_counter() - t_start
            runs["req_per_s"].append(len(prompts) / elapsed)
            runs["blocks_stored_per_s"].append(stored_blocks / elapsed)
            runs["stored_mb_per_s"].append(stored_blocks * a.payload / elapsed / 1e6)
            runs["lookup_p50_us"].append(percentile(look, 50) * 1e6)
            runs["save_p50_us"].append(percentile(save, 50) * 1e6)
    finally:
        c.close()
    input_tokens = sum(r["input_length"] for r in requests)
    span = (requests[-1]["timestamp"] - requests[0]["timestamp"]) / 1000
    return {"trace": str(a.trace), "window_s": span, "requests": len(requests), "input_tokens": input_tokens,
            "hit_tokens": hit_tokens, "ideal_hit_tokens": ideal_hits(requests, id_tokens),
            "stored_blocks": stored_blocks, "payload_bytes": a.payload, "runs": a.runs,
            **{k: summary(v) for k, v in runs.items()}}


# -- workload 4: small calls -------------------------------------------------------------------
LONG_BLOCKS = 2048   # a 32k-token prompt at 16 tokens a block
PACE_S = 0.003       # between the paced calls: a 2,048-block lookup takes the daemon ~1 ms here


def _sha256_chain_floor(tokens: np.ndarray) -> bytes:
    """The least a chain of sha256 block hashes costs in Python: the tokens encoded once
    (vectorised), then one join and one sha256 per block; no memo, no checks."""
    from kvstored_client.contract.hashing import _encode_uints

    encoded, ends = _encode_uints(tokens)
    parent, begin = b"\0" * 32, 0
    sha256 = hashlib.sha256
    for end in ends[BLOCK - 1:: BLOCK].tolist():
        parent = sha256(b"".join((b"\x83\x58\x20", parent, b"\x90", encoded[begin:end], b"\xf6"))).digest()
        begin = end
    return parent


def smallcall(a: argparse.Namespace) -> dict[str, Any]:
    """Each small call through the SDK over gRPC, over the fast path, and lookups answered from
    the daemon's presence table (three clients of one daemon), the 32k-token lookup by
    precomputed hashes and with client-side hashing of a new prompt too, and a bare gRPC unary
    for scale."""
    import kvstored
    from kvstored_client.connection import PRESENCE_ENV
    from kvstored_client.contract.hashing import ChainHasher
    from tools.bench import baregrpc

    table = kvstored.Client(a.socket)
    os.environ[PRESENCE_ENV] = "0"   # (read when a client is made)
    try:
        fast = kvstored.Client(a.socket)
    finally:
        del os.environ[PRESENCE_ENV]
    slow = kvstored.Client(a.socket, fast_path=False)
    tokens = np.arange(BLOCK, dtype=np.uint32)
    fast.save(tokens, np.zeros((1, 64), dtype=np.uint8))
    one = kvstored.block_hashes(tokens)
    long_chain = kvstored.block_hashes(np.arange(BLOCK * LONG_BLOCKS, dtype=np.uint32) + 10**6)
    fast.save(None, np.zeros((LONG_BLOCKS, 64), dtype=np.uint8), hashes=long_chain)
    # a new 32k-token prompt each call: every block hashed (no memo hit), none cached
    new_prompt = np.arange(BLOCK * LONG_BLOCKS, dtype=np.uint32) + 2 * 10**6
    calls: dict[str, Callable[[], object]] = {}
    for client, how in ((slow, "gRPC"), (fast, "fast path"), (table, "presence table")):
        if client.lookup_transport != {"gRPC": "grpc", "fast path": "frames", "presence table": "table"}[how]:
            raise RuntimeError(f"the {how} client's lookups travel by {client.lookup_transport} "
                               "(server.fast_socket or server.presence_table = false?)")
        fresh = itertools.count(1)
        calls |= {
            f"kvstored lookup(hashes=[1 block]) over {how}": functools.partial(client.lookup, hashes=one),
            f"kvstored lookup(16 tokens) over {how}": functools.partial(client.lookup, tokens),
            **({} if how == "presence table" else {f"kvstored stats() over {how}": client.stats}),
            f"kvstored lookup(hashes=[{LONG_BLOCKS:,} blocks]) over {how}": functools.partial(
                client.lookup, hashes=long_chain),
            f"kvstored lookup(new {LONG_BLOCKS * BLOCK // 1024}k-token prompt, hashed in the SDK) over {how}":
                lambda client=client, fresh=fresh: client.lookup(new_prompt + next(fresh)),
        }
    # The hashing alone, beside the interpreter's floor for it: one sha256 of each block's
    # message (parent hash and the block's tokens, CBOR-encoded), nothing else, in a Python loop.
    # A chain cannot be hashed in parallel, so no SDK hashing in Python goes below that floor.
    hasher, hasher_fresh = ChainHasher(BLOCK), itertools.count(1)   # with its memo, as a client keeps it
    calls[f"SDK hashing of a new {LONG_BLOCKS * BLOCK // 1024}k-token prompt alone (ChainHasher, no call)"] = \
        lambda: hasher.hashes(new_prompt + next(hasher_fresh))
    floor_fresh = itertools.count(1)
    calls[f"floor: a bare sha256 chain over the same {LONG_BLOCKS:,} blocks (Python loop, no memo)"] = \
        lambda: _sha256_chain_floor(new_prompt + next(floor_fresh))
    # Back to back, the table's long lookups wait for room on the socket that takes them one-way:
    # the daemon's handling of the previous ones (as long as an RPC lookup's). Paced, the SDK's
    # own cost: each call after a pause long enough for the daemon to be done (not timed).
    paced = f"kvstored lookup(hashes=[{LONG_BLOCKS:,} blocks]) over presence table, {PACE_S * 1e3:g} ms apart"
    calls[paced] = functools.partial(table.lookup, hashes=long_chain)
    out: dict[str, Any] = {}
    try:
        with baregrpc.Server() as server:
            bare = baregrpc.Client(server.path)
            calls["bare gRPC unary (Unix socket, grpc.aio server)"] = lambda: bare.call(b"x" * 40)
            try:
                for name, fn in calls.items():
                    for _ in range(50):
                        fn()
                    pause = PACE_S if name == paced else 0.0
                    per_run: list[list[float]] = []
                    for _ in range(a.runs):
                        samples = []
                        for _ in range(a.calls):
                            if pause:
                                time.sleep(pause)
                            t0 = time.perf_counter()
                            fn()
                            samples.append(time.perf_counter() - t0)
                        per_run.append(samples)
                    out[name] = _lat_stats(per_run)
            finally:
                bare.close()
    finally:
        table.close()
        fast.close()
        slow.close()
    return {"calls": out, "calls_per_run": a.calls, "runs": a.runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["prefix", "trace", "smallcall"])
    p.add_argument("--socket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--suffix-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--payload", type=int, default=256)
    p.add_argument("--trace", default="")
    p.add_argument("--window-s", type=float, default=600)
    p.add_argument("--max-requests", type=int, default=3000)
    p.add_argument("--calls", type=int, default=500)
    a = p.parse_args(argv)
    with worker_output(a.out) as result:
        result.update({"prefix": prefix, "trace": trace, "smallcall": smallcall}[a.what](a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
