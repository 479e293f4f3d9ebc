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
    for contender in ("memcpy", "kvstored save/load", "kvstored save_blocks/load_blocks"):
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


def test_the_raw_tcp_limit_lands_each_block_in_a_slot_of_its_own() -> None:
    """bench_cluster's limit moves what kvstored moves: as many distinct blocks as the run, each
    received into its own slot (as B lands blocks in its arena), not one buffer over and over."""
    import argparse

    sys.path.insert(0, str(ROOT))
    from tools.bench_peers import RawReceiver, start_sender, stop_sender

    size, count = 64 << 10, 6
    proc, port = start_sender("raw", argparse.Namespace(blocks=count, block_bytes=size))
    receiver = RawReceiver(port, size, slots=count)
    try:
        assert receiver.run(count, size) > 0
        # the sender stamps block i's first 8 bytes with i
        assert [int.from_bytes(receiver.buf[i * size:i * size + 8], "big") for i in range(count)] == list(range(count))
    finally:
        receiver.close()
        stop_sender(proc)


def test_the_ssd_benchmark_runs_the_tier_and_the_daemon_path_and_prints_both_tables(tmp_path: Path) -> None:
    """``tools/bench_ssd.py`` in a tiny run: every tier row against raw, the daemon's load and
    stream of a prompt found on SSD only, and its load of many small blocks with another client's
    calls meanwhile (the run itself checks the bytes each returns)."""
    proc = subprocess.run([sys.executable, "tools/bench_ssd.py", "--dir", str(tmp_path), "--blocks", "8",
                           "--runs", "1", "--daemon-blocks", "4", "--small-blocks", "64", "--read-threads", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for name in ("raw write", "tier write", "raw read", "tier read", "tier read, the daemon's depth",
                 "tier read after churn",
                 "raw read of the load's blocks, the daemon's depth", "daemon load_blocks from SSD",
                 "daemon load_blocks from DRAM", "daemon stream from SSD", "daemon stream from SSD, out of the arena",
                 "daemon stream from SSD out of the arena, first block", "raw read of one block",
                 "daemon stream from SSD, first block", "daemon stream from DRAM, first block",
                 "raw 64 KiB reads, the daemon's depth (GB/s)", "daemon load_blocks from SSD (GB/s)",
                 "lookup, daemon idle, median (ms)", "lookup during the load, median (ms)",
                 "lookup during the load, max (ms)"):
        assert name in rows, f"row {name!r} missing:\n{proc.stdout}"
        figures = [float(x) for x in rows[name].split("|")[2:6]]
        assert all(f > 0 for f in figures), rows[name]
    # every comparison at the depth asked for: the daemons were started with that many read threads
    assert "the daemon's depth 3" in proc.stdout and proc.stdout.count("3 read threads") == 2, proc.stdout
    assert not list(tmp_path.iterdir()), f"the run left files behind: {list(tmp_path.iterdir())}"


def test_the_gc_benchmark_prints_every_pause() -> None:
    """``tools/bench_gc.py`` in a tiny run: the full pass before and after the freeze, the freezes
    and the thaw (the figures themselves are for BENCHMARKS.md, not asserted)."""
    proc = subprocess.run([sys.executable, "tools/bench_gc.py", "--blocks", "20000", "--new", "2000", "--runs", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for name in ("full pass, nothing frozen", "the freeze (a pass, then gc.freeze)", "full pass after the freeze",
                 "the next freeze, 2,000 blocks later", "a thaw (everything unfrozen, one full pass, frozen again)"):
        assert name in rows, f"row {name!r} missing:\n{proc.stdout}"
        assert float(rows[name].split("|")[2]) >= 0
