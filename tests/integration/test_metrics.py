"""Prometheus metrics of a running daemon, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
from loopback import free_ports
from prometheus_client.parser import text_string_to_metric_families

import kvstored
from conftest import start_daemon


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_scrape_reports_what_the_daemon_did(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    d = start_daemon(tmp_path, "--set", f"server.metrics=127.0.0.1:{port}")
    try:
        with kvstored.Client(d.socket) as c:
            tokens = np.arange(16 * 4)
            c.save(tokens, np.ones((4, 4096), np.uint8))
            assert c.load(tokens).blocks == 4
            assert len(list(c.stream(tokens, peers=False))) == 4   # a server stream, timed to its end
            got = scrape(port)
        assert got[("kvstored_saved_blocks_total", ())] == 4
        assert got[("kvstored_hit_blocks_total", ())] == 8   # the load and the stream
        assert got[("kvstored_index_blocks", ())] == 4
        assert got[("kvstored_tier_used_bytes", (("tier", "dram"),))] == 4 * 4096
        assert got[("kvstored_tier_capacity_bytes", (("tier", "ssd"),))] == 256 << 20
        assert ("kvstored_tier_evictions_total", (("tier", "ssd"),)) in got
        assert got[("kvstored_clients", ())] >= 1
        # every call is timed by method: the save's Reserve and Seal, the load's stream
        assert got[("kvstored_rpc_duration_seconds_count", (("method", "Reserve"),))] >= 1
        assert got[("kvstored_rpc_duration_seconds_count", (("method", "Seal"),))] >= 1
        assert got[("kvstored_rpc_duration_seconds_sum", (("method", "Seal"),))] > 0
        assert got[("kvstored_rpc_duration_seconds_count", (("method", "StreamBlocks"),))] == 1
    finally:
        d.stop()


def test_a_metrics_address_in_use_is_a_startup_error(tmp_path: Path) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = start_daemon(tmp_path, "--set", f"server.metrics=127.0.0.1:{port}", wait=False)
        assert d.proc.wait(timeout=60) == 1
        assert "cannot serve server.metrics" in d.log()


def test_lookups_in_a_namespace_nothing_was_saved_in_open_it_once(tmp_path: Path) -> None:
    """Its block size is unknown until a save fixes it; a lookup does not need it, so a client
    that only looks up (a scheduler on a cold node) does not ask the daemon again each call."""
    (port,) = free_ports(1)
    d = start_daemon(tmp_path, "--set", f"server.metrics=127.0.0.1:{port}")
    try:
        with kvstored.Client(d.socket) as c, kvstored.Client(d.socket, fast_path=False) as grpc_only:
            tokens = np.arange(16 * 4)
            for client in (c, grpc_only):
                for _ in range(20):
                    assert client.lookup(tokens).blocks == 0
            opened = scrape(port)[("kvstored_rpc_duration_seconds_count", (("method", "OpenNamespace"),))]
            assert opened <= 2, f"{opened} OpenNamespace calls for 40 lookups by two clients"
            c.save(tokens, np.ones((4, 4096), np.uint8))   # fixes the size: streams learn it
            assert [len(b.data) for b in grpc_only.stream(tokens, peers=False)] == [4096] * 4
    finally:
        d.stop()
