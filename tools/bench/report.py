"""The report: a Markdown table from ``results.json`` (medians, min, max, ratios, targets).

The chart of the same results is drawn by :mod:`tools.bench.chart`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

KV_ARENA = "kvstored save/load"
KV_REG = "kvstored save_blocks/load_blocks"
KV_BEHIND = "kvstored save(wait=False)/load"
MEMCPY = "memcpy"
PEER_LABELS = {"redis": "Redis", "mooncake": "Mooncake Store", "lmcache": "LMCache (CPU, in-process)"}
KVSTORED = (KV_ARENA, KV_BEHIND, KV_REG)


def size_label(b: int) -> str:
    """A block size as the tables and the chart write it: ``2 MiB``, ``256 KiB``."""
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def _f(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}"


def median(values: list[float]) -> float:
    """The median of per-run figures (NaN when there are none)."""
    s = sorted(values)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def putget_rows(results: dict[str, Any]) -> dict[tuple[str, int, int], dict[str, dict[str, Any]]]:
    """(op, block bytes, batch) -> contender -> its figures."""
    table: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for c in results.get("putget", []):
        for r in c.get("results", []):
            table.setdefault((r["op"], r["block_bytes"], r["batch"]), {})[c["contender"]] = r
    return table


def _peer_best(row: dict[str, dict[str, Any]]) -> tuple[str, float] | None:
    peers = [(name, median(r["gbps"])) for name, r in row.items() if name not in KVSTORED and name != MEMCPY]
    return max(peers, key=lambda p: p[1]) if peers else None


def ratio(results: dict[str, Any], contender: str, op: str, size: int, batch: int,
          against: str | None = None) -> float | None:
    row = putget_rows(results).get((op, size, batch), {})
    if contender not in row:
        return None
    mine = median(row[contender]["gbps"])
    if against is None:
        best = _peer_best(row)
        return mine / best[1] if best else None
    if against not in row:
        return None
    return mine / median(row[against]["gbps"])


def markdown(results: dict[str, Any]) -> str:
    out: list[str] = []
    w = out.append
    mode = "quick" if results.get("quick") else "full"
    w(f"# kvstored benchmark ({mode} run, {results.get('started', '')})\n")
    w(f"Machine: {results.get('machine', '?')}. Every figure is the median (min-max) over "
      f"{results.get('runs')} timed runs after a warm-up run, all contenders in this one run. "
      f"Put/get working set: {results.get('working_set_bytes', 0) >> 20} MiB of distinct rows per block size. "
      "Each kvstored daemon is fresh (own socket, empty state directory), started with "
      f"`--dram-capacity` sized to the working set, `dram.page_bytes=32MiB` (put/get daemons also "
      "`dram.policy=lru`: each pass writes fresh keys and relies on eviction of the oldest)"
      f"{''.join(', ' + x for x in results.get('daemon_set', []))}; otherwise its defaults.\n")

    # -- workload 1 ---------------------------------------------------------------------------
    w("## Put/get of KV blocks (GB/s, higher is better)\n")
    w("`x memcpy`: against the per-block numpy copy between warm heap and shared-memory buffers in this run "
      "(put: heap→shm, get: shm→heap). `x best peer`: against the fastest of Redis, Mooncake, LMCache in the "
      "same row. Per call: median latency of one put/get call (one block or a batch of 32).\n")
    w("| op | block | batch | contender | GB/s median | min | max | per call µs | x memcpy | x best peer | notes |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    table = putget_rows(results)
    contenders = [c["contender"] for c in results.get("putget", [])]
    order = [MEMCPY, KV_ARENA, KV_BEHIND, KV_REG] + [c for c in contenders if c not in (MEMCPY, *KVSTORED)]
    for row_key in sorted(table, key=lambda k: (-k[1], k[2], k[0] != "get")):
        op, size, batch = row_key
        row = table[row_key]
        best = _peer_best(row)
        for name in order:
            r = row.get(name)
            if r is None:
                continue
            g = r["gbps"]
            med = median(g)
            lim = row.get(MEMCPY)
            x_lim = med / median(lim["gbps"]) if lim and name != MEMCPY else None
            x_peer = med / best[1] if best and name in KVSTORED else None
            notes = []
            if r.get("short_blocks"):
                notes.append(f"{r['short_blocks']} blocks missing")
            if r.get("wrong_rows"):
                notes.append(f"{r['wrong_rows']} rows with wrong bytes")
            if best and name in KVSTORED:
                notes.append(f"best peer: {best[0]}")
            w(f"| {op} | {size_label(size)} | {batch} | {name} | {_f(med)} | {_f(min(g))} | {_f(max(g))} | "
              f"{_f(median(r['op_us']), 0)} | {_f(x_lim)} | {_f(x_peer)} | {'; '.join(notes)} |")
    failed = [c for c in results.get("putget", []) if c.get("error") and not c.get("results")]
    partial = [c for c in results.get("putget", []) if c.get("error") and c.get("results")]
    for c in failed:
        w(f"| put/get | all | all | {c['contender']} | — | — | — | — | — | — | {c['error']} |")
    for c in partial:
        w(f"| put/get | some | some | {c['contender']} | | | | | | | partly failed: {c['error']} |")
    for name, why in results.get("skipped", {}).items():
        if name in PEER_LABELS:
            w(f"| put/get | all | all | {PEER_LABELS[name]} | — | — | — | — | — | — | {why} |")
    notes = [f"{c['contender']}: {c['notes']}" for c in results.get("putget", []) if c.get("notes")]
    if notes:
        w("\nContender notes: " + "; ".join(notes) + ".")
    w("")

    # -- limits -------------------------------------------------------------------------------
    if results.get("streams"):
        w("## Limits: streaming between two processes (GB/s)\n")
        w("| transport | chunk | median | min | max |")
        w("|---|---|---|---|---|")
        for r in results["streams"]:
            kind = "Unix socket (4 MiB buffers)" if r["kind"] == "unix" else "loopback TCP"
            w(f"| {kind} | {size_label(r['block_bytes'])} | {_f(r['median'])} | {_f(r['min'])} | {_f(r['max'])} |")
        w("")

    # -- workload 2 ---------------------------------------------------------------------------
    pre = results.get("prefix")
    if pre:
        w(f"## Prefix reuse: lookup of a {pre['prompt_tokens']:,}-token prompt ({pre['prompt_blocks']:,} blocks)\n")
        w(f"{pre['requests_per_run']} requests per run share a {pre['system_tokens']:,}-token system prompt and "
          "have unique suffixes. Cold: first lookup of each new prompt (its 2k-token suffix is hashed; the "
          "shared prefix's hashes come from the SDK's memo, except for the first request of a run); warm: the "
          "same prompt again (every hash from the memo); by hashes: precomputed block hashes; hashing alone: "
          "all blocks hashed without the memo (a prompt the client has never seen pays this on top). "
          "Per-run p50/p99 in µs, median (min-max) over runs.\n")
        w("| lookup | p50 µs | p50 min-max | p99 µs | p99 min-max | samples |")
        w("|---|---|---|---|---|---|")
        for key, label in (("cold", "cold (new suffix, memoized prefix)"), ("warm", "warm (memoized hashes)"),
                           ("by_hash", "by precomputed hashes"), ("hash_only", "hashing alone (client)")):
            s = pre[key]
            w(f"| {label} | {_f(s['p50_us']['median'], 0)} | {_f(s['p50_us']['min'], 0)}-{_f(s['p50_us']['max'], 0)}"
              f" | {_f(s['p99_us']['median'], 0)} | {_f(s['p99_us']['min'], 0)}-{_f(s['p99_us']['max'], 0)}"
              f" | {s['samples']} |")
        frac = pre["served_tokens"] / pre["total_tokens"] if pre["total_tokens"] else float("nan")
        w(f"\nTokens served from cache: {pre['served_tokens']:,} of {pre['total_tokens']:,} ({frac:.1%}).\n")

    # -- workload 3 ---------------------------------------------------------------------------
    tr = results.get("trace")
    if tr:
        w("## Trace replay\n")
        w(f"`{Path(tr['trace']).name}`: the first {tr['window_s']:.0f} s, {tr['requests']:,} requests, "
          f"{tr['input_tokens']:,} input tokens; each hash id is 512 tokens from a PRNG seeded by the id; "
          f"{tr['payload_bytes']} B per 16-token block; replayed as fast as possible, {tr['runs']} runs.\n")
        ideal = tr["ideal_hit_tokens"]
        w("| figure | median | min | max |")
        w("|---|---|---|---|")
        for key, label in (("req_per_s", "requests/s (hash + lookup + save)"),
                           ("blocks_stored_per_s", "blocks stored/s"), ("stored_mb_per_s", "stored MB/s"),
                           ("lookup_p50_us", "lookup p50 µs (hashing included)"), ("save_p50_us", "save p50 µs")):
            s = tr[key]
            w(f"| {label} | {_f(s['median'], 1)} | {_f(s['min'], 1)} | {_f(s['max'], 1)} |")
        w(f"\nHit tokens: {tr['hit_tokens']:,} of {tr['input_tokens']:,} "
          f"({tr['hit_tokens'] / tr['input_tokens']:.1%}); an infinite prefix cache would hit {ideal:,} "
          f"({ideal / tr['input_tokens']:.1%}). Blocks stored: {tr['stored_blocks']:,}.\n")

    # -- workload 4 ---------------------------------------------------------------------------
    sc = results.get("smallcall")
    if sc:
        w("## Small-call round trip (µs, lower is better)\n")
        w(f"{sc['calls_per_run']} calls per run after 50 warm-up calls.\n")
        w("| call | p50 µs | min-max | p99 µs | x bare gRPC p50 |")
        w("|---|---|---|---|---|")
        bare = next((v for k, v in sc["calls"].items() if k.startswith("bare")), None)
        for name, s in sc["calls"].items():
            x = s["p50_us"]["median"] / bare["p50_us"]["median"] if bare else None
            w(f"| {name} | {_f(s['p50_us']['median'], 0)} | {_f(s['p50_us']['min'], 0)}-{_f(s['p50_us']['max'], 0)}"
              f" | {_f(s['p99_us']['median'], 0)} | {_f(x)} |")
        w("")

    # -- workload 5 ---------------------------------------------------------------------------
    ix = results.get("index")
    if ix:
        w("## Index memory\n")
        policy = (f"; with the records of the default eviction policy (`{ix['policy']}`) tracking every "
                  f"block: {ix['with_policy_bytes_per_block']:.0f} B/block") if "policy" in ix else ""
        w(f"`PrefixIndex` + `Block` (sealed) with 32-byte keys, {ix['blocks']:,} blocks in "
          f"chains of 2,048, counted by tracemalloc: **{ix['bytes_per_block']:.0f} B/block** "
          f"(built in {ix['build_s']:.1f} s under tracemalloc){policy}.\n")

    # -- targets ------------------------------------------------------------------------------
    w("## Targets (goals, not assertions)\n")
    w("| target | measured | met |")
    w("|---|---|---|")
    for label, value, goal, fmt in _targets(results):
        met = "—" if value is None else ("yes" if goal(value) else "no")
        w(f"| {label} | {fmt(value) if value is not None else 'not measured'} | {met} |")
    w("")

    # -- problems -----------------------------------------------------------------------------
    errors = results.get("errors", {})
    skipped = {k: v for k, v in results.get("skipped", {}).items() if k not in PEER_LABELS}
    if errors or skipped:
        w("## Not measured\n")
        for k, v in skipped.items():
            w(f"- {k}: skipped: {v}")
        for k, v in errors.items():
            w(f"- {k}: failed: {v}")
        w("")
    return "\n".join(out) + "\n"


def _targets(results: dict[str, Any]) -> list[tuple[str, float | None, Any, Any]]:
    x = lambda v: f"{v:.2f}x"  # noqa: E731
    out: list[tuple[str, float | None, Any, Any]] = []
    mib2, k256 = 2 << 20, 256 << 10
    for kv, short in ((KV_ARENA, "save/load"), (KV_REG, "save_blocks/load_blocks")):
        for size in (mib2, k256):
            for op, verb in (("get", "load"), ("put", "save")):
                out.append((f"kvstored {short}: {verb} {size_label(size)} x32 ≥ 0.7x memcpy",
                            ratio(results, kv, op, size, 32, MEMCPY), lambda v: v >= 0.7, x))
        for peer, peer_op in (("Redis", "GET"), ("Mooncake Store", "get")):
            for op, verb, pop in (("get", "load", peer_op), ("put", "save", "SET" if peer == "Redis" else "put")):
                out.append((f"kvstored {short}: {verb} 2 MiB x32 ≥ 3x {peer} {pop}",
                            ratio(results, kv, op, mib2, 32, peer), lambda v: v >= 3, x))
    pre = results.get("prefix")
    us = lambda v: f"{v / 1000:.2f} ms"  # noqa: E731
    for key, label in (("warm", "warm"), ("cold", "cold"), ("by_hash", "by hashes")):
        out.append((f"lookup p50 of a 32k-token prompt ({label}) < 2 ms",
                    pre[key]["p50_us"]["median"] if pre else None, lambda v: v < 2000, us))
    ix = results.get("index")
    out.append((f"index memory at {ix['blocks']:,} blocks ≤ 300 B/block" if ix else "index memory ≤ 300 B/block",
                ix["bytes_per_block"] if ix else None, lambda v: v <= 300, lambda v: f"{v:.0f} B"))
    sc = results.get("smallcall")
    if sc:
        calls = sc["calls"]
        bare = next((v for k, v in calls.items() if k.startswith("bare")), None)
        lookup = calls.get("kvstored lookup(hashes=[1 block]) over fast path")
        long = next((v for k, v in calls.items() if k.startswith("kvstored lookup(hashes=[2,048")
                     and k.endswith("over fast path")), None)
        us_ = lambda v: f"{v:.0f} µs"  # noqa: E731
        out.append(("lookup of 1 block p50 over the fast path ≤ 100 µs",
                    lookup["p50_us"]["median"] if lookup else None, lambda v: v <= 100, us_))
        out.append(("lookup of a 32k-token prompt by hashes p50 over the fast path ≤ 0.7 ms",
                    long["p50_us"]["median"] if long else None, lambda v: v <= 700, us))
        table = calls.get("kvstored lookup(hashes=[1 block]) over presence table")
        new = next((v for k, v in calls.items() if k.startswith("kvstored lookup(new ")
                    and k.endswith("over presence table")), None)
        out.append(("lookup of 1 block p50 from the presence table ≤ 100 µs",
                    table["p50_us"]["median"] if table else None, lambda v: v <= 100, us_))
        out.append(("lookup of a new 32k-token prompt, hashed in the SDK, p50 from the presence table ≤ 2 ms",
                    new["p50_us"]["median"] if new else None, lambda v: v <= 2000, us))
        if bare and lookup:
            out.append(("small call (lookup of 1 block) next to bare gRPC p50 (informational; goal ≤ 1.5x)",
                        lookup["p50_us"]["median"] / bare["p50_us"]["median"], lambda v: v <= 1.5, x))
    return out
