"""The metrics endpoint: a scrape the event loop cannot answer in time fails on its own."""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request

import pytest

from kvstored.server import metrics
from kvstored.store import StoreStats


def test_a_scrape_the_loop_cannot_answer_is_a_503_and_one_log_line(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """(review) A scrape whose snapshot the event loop did not hand over within SCRAPE_TIMEOUT_S
    (the loop blocked or very busy) answered 500 and wrote a full traceback to the journal, at
    every scrape for as long as the loop stayed busy."""
    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 0.2)
    stalled = asyncio.new_event_loop()   # never run: no snapshot ever comes

    def snapshot() -> metrics.Snapshot:
        raise AssertionError("the stalled loop ran the snapshot")

    server = metrics.serve_metrics("127.0.0.1:0", stalled, snapshot)
    try:
        port = server.server_address[1]
        with caplog.at_level(logging.WARNING, logger="kvstored.server.metrics"), \
                pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert err.value.code == 503
        assert b"did not answer within 0.2 s" in err.value.read()
    finally:
        server.shutdown()
        server.server_close()
        stalled.run_until_complete(asyncio.sleep(0.01))   # the late snapshot starts, and is cancelled
        stalled.close()
    assert "Traceback" not in capfd.readouterr().err
    assert [r.getMessage() for r in caplog.records] == [
        "metrics scrape failed: the event loop did not answer within 0.2 s (busy or blocked)"]


def test_a_scrape_the_loop_answers_reports_the_snapshot() -> None:
    import threading

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    stats = StoreStats(1.0, [], *([0] * 12))
    server = metrics.serve_metrics("127.0.0.1:0", loop, lambda: metrics.Snapshot(stats, 3, 1))
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert resp.status == 200 and "kvstored_peer_pushed_blocks_total 3.0" in text, text
    finally:
        server.shutdown()
        server.server_close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_a_host_name_is_bound_in_the_family_it_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """(review) server.metrics may name a host ("node1.example:9100"). prometheus-client's server,
    used before, bound it in the family the name resolves to; our own server took every address
    without a ':' for IPv4, so a name that resolves to IPv6 only (an IPv6-only cluster's node names)
    no longer bound and the daemon refused to start."""
    import socket

    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        if host == "v6-only.invalid":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))]
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    loop = asyncio.new_event_loop()
    stats = StoreStats(1.0, [], *([0] * 12))
    server = metrics.serve_metrics("v6-only.invalid:0", loop, lambda: metrics.Snapshot(stats))
    try:
        assert server.socket.family == socket.AF_INET6 and server.server_address[0] == "::1"
    finally:
        server.shutdown()
        server.server_close()
        loop.close()
