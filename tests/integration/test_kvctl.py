"""`kvctl stats`: a readable table and --json, against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

import kvstored


def kvctl(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "kvstored.kvctl", "--socket", socket, *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_stats_table_and_json(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket) as c:
        c.save(np.arange(64), np.ones((4, 2048), np.uint8))
        c.lookup(np.arange(80))
        out = kvctl(daemon.socket, "stats")
        assert out.returncode == 0, out.stderr
        for needle in ("dram", "64.0 MiB", "8.0 KiB", "hit tokens", "64", "active leases", "clients",
                       f"kvstored {kvstored.__version__}", "up 00:00:"):
            assert needle in out.stdout, (needle, out.stdout)
        data = json.loads(kvctl(daemon.socket, "stats", "--json").stdout)
    assert data["tiers"][0] == {"name": "dram", "capacity_bytes": 64 << 20, "used_bytes": 4 * 2048,
                                "blocks": 4, "evictions": 0, "write_errors": 0, "read_errors": 0}
    assert data["tiers"][1]["name"] == "ssd" and data["tiers"][1]["capacity_bytes"] == 256 << 20
    assert data["hit_tokens"] == 64 and data["lookups"] == 1 and data["saved_blocks"] == 4
    assert data["clients"] == 1  # the SDK client above; kvctl itself opens no session


def test_stats_without_daemon_says_how_to_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = kvctl(str(tmp_path / "none.sock"), "stats")
    assert out.returncode == 1
    assert "Start one with `kvstored`" in out.stderr
