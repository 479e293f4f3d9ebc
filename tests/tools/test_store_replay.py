"""The trace replay through the real store (tools/store_replay.py), on a small generated trace."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvstored.policy.registry import DEFAULT_POLICY

ROOT = Path(__file__).resolve().parents[2]


def test_a_generated_trace_replays_through_both_tiers() -> None:
    """Every row is there; the store's hits are in per-block LRU's range (the same capacity, a
    policy that is not blind to the tree), some of them from DRAM, and the two tiers' policies
    both ran: a DRAM tier smaller than the SSD tier means blocks came up from SSD."""
    out = subprocess.run([sys.executable, "-m", "tools.store_replay", "--shape", "chat", "--requests", "400",
                          "--capacities", "10", "--policies", f"lru,credit,{DEFAULT_POLICY}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = re.compile(r"^\| 10% \| [^|]+ \| ([^|]+) \| ([\d,]+) \| [^|]+ \| ([\d.]+) \| ([^|]*) \|", re.M)
    rows = {re.sub(r"\*|\(default\)", "", m.group(1)).strip(): m for m in row.finditer(out.stdout)}
    assert set(rows) == {"per-block LRU", "lru", "credit", DEFAULT_POLICY}, out.stdout
    for name in ("lru", "credit", DEFAULT_POLICY):
        hits, ratio, share = int(rows[name].group(2).replace(",", "")), float(rows[name].group(3)), rows[name].group(4)
        assert hits > 0 and 0.8 < ratio < 3.0, out.stdout
        assert 0 < int(share.strip(" %")) < 100, out.stdout   # hits from both tiers


def test_the_dram_policy_can_be_set_apart_from_the_ssd_policy() -> None:
    """``--dram-policy``: every run's DRAM tier takes that policy, its SSD tier the run's own (the
    row says so). On chat, credit in DRAM keeps the reused blocks there: more of the hits are from
    DRAM than with lru in both tiers, over the same trace and capacities."""
    def rows(*extra: str) -> dict[str, str]:
        out = subprocess.run([sys.executable, "-m", "tools.store_replay", "--shape", "chat", "--requests", "400",
                              "--capacities", "10", "--policies", "lru", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        found = re.finditer(r"^\| 10% \| [^|]+ \| ([^|]+) \| [^|]+ \| [^|]+ \| [^|]+ \| ([^|]*) \|", out.stdout, re.M)
        return {m.group(1).strip(): m.group(2).strip() for m in found}

    plain, split = rows(), rows("--dram-policy", "credit")
    assert set(split) == {"per-block LRU", "lru (DRAM: credit)"}, split
    assert int(split["lru (DRAM: credit)"].rstrip("%")) > int(plain["lru"].rstrip("%")), (plain, split)
