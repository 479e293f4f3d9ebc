"""The cyclic garbage collector's pause with a large index, in-process: a full pass (what Python
starts by itself each time the long-lived objects have grown by a quarter, with every other call
waiting) over a ``PrefixIndex`` of ``--blocks`` blocks and their default-policy records, before and
after ``kvstored.server.gc_freeze.freeze`` (what the daemon does every ``server.gc_freeze_interval_s``);
the freeze itself, at start and after ``--new`` more blocks (saves between two freezes).
Medians of ``--runs`` passes, in milliseconds.

    .venv/bin/python -m tools.bench gc [--blocks 1000000] [--new 50000] [--runs 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvstored import index as index_mod
from kvstored.policy.registry import DEFAULT_POLICY, make_policy
from kvstored.server import gc_freeze
from tools.bench.index_mem import fill, sealer


def full_pass_ms(runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench gc", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--new", type=int, default=50_000)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args(argv)
    seal = sealer(index_mod)
    index = index_mod.PrefixIndex(1)
    policy = make_policy(DEFAULT_POLICY, lambda: 0.0, a.blocks + a.new)
    for chain in fill(index, a.blocks, seal):
        policy.inserted(chain)  # type: ignore[arg-type]
    rows = [("full pass, nothing frozen", full_pass_ms(a.runs))]
    rows.append(("the freeze (a pass, then gc.freeze)", gc_freeze.freeze() * 1e3))
    rows.append(("full pass after the freeze", full_pass_ms(a.runs)))
    for chain in fill(index, a.new, seal, first=a.blocks):
        policy.inserted(chain)  # type: ignore[arg-type]
    rows.append((f"the next freeze, {a.new:,} blocks later", gc_freeze.freeze() * 1e3))
    rows.append(("a thaw (everything unfrozen, one full pass, frozen again)", gc_freeze.thaw() * 1e3))
    gc.unfreeze()
    print(f"\nThe collector with an index of {a.blocks:,} blocks ({DEFAULT_POLICY} policy), ms, medians of {a.runs}\n")
    print("| pause | ms |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")
    return 0
