"""The benchmark harness runs end to end in quick mode without peers and writes its table.

Speed is not asserted (the machine is shared and small); only that every kvstored and limit row
is there, that nothing failed, and that no process or shared-memory file is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tiny_trace(path: Path) -> None:
    lines = []
    for i in range(12):
        ids = [0, 1, 2, 100 + i]  # a shared 3 x 512-token prefix, then a unique block
        lines.append(json.dumps({"timestamp": i * 500, "input_length": 4 * 512 - 100, "output_length": 10,
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def test_quick_run_without_peers_writes_the_table(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace)
    shm = Path(tempfile.mkdtemp(prefix="kvbench-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.bench", "--quick", "--no-peers", "--results-dir", str(tmp_path / "results"),
             "--trace", str(trace), "--ws-mib", "32", "--shm-dir", str(shm)],
            cwd=ROOT, capture_output=True, text=True, timeout=240)
        left_files = sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "results").glob("bench-*"))
    assert len(runs) == 1, runs
    table = (runs[0] / "results.md").read_text()
    results = json.loads((runs[0] / "results.json").read_text())

    assert results["errors"] == {}, results["errors"]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for contender in ("memcpy", "kvstored save/load", "kvstored save(wait=False)/load",
                      "kvstored save_blocks/load_blocks"):
        for op in ("get", "put"):
            for size in ("2 MiB", "256 KiB"):
                for batch in ("1", "32"):
                    assert any(r.startswith(f"| {op} | {size} | {batch} | {contender} |") for r in rows), \
                        (contender, op, size, batch, table)
    # Regression: with the credit policy the put/get daemons evicted each pass's new blocks before
    # their get, and the table showed misses as throughput. Every kvstored get must find its blocks.
    for r in results["putget"]:
        if r["contender"].startswith("kvstored"):
            for row in r["results"]:
                assert row["short_blocks"] == 0 and row["wrong_rows"] == 0, (r["contender"], row)
    for section in ("## Limits: streaming", "## Prefix reuse", "## Trace replay", "## Small-call round trip",
                    "## Index memory", "## Targets"):
        assert section in table, section
    for peer in ("Redis", "Mooncake Store", "LMCache"):
        assert any(peer in r and "not requested" in r for r in rows), peer
    assert (runs[0] / "chart.png").exists() or (runs[0] / "chart.txt").exists()
    assert left_files == [], f"shared-memory files left behind: {left_files}"
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "processes left behind"
