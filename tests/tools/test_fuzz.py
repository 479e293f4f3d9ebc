"""tools.fuzz against a daemon it starts: a clean report on a few hundred requests, and a report
that fails when a status is not in the README's table."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tools import fuzz


def test_a_few_hundred_requests_report_no_crash_hang_or_undocumented_status(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert fuzz.main(["--requests", "300", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("seed 7\n")
    assert "300 requests" in out and "crashes: 0  hangs: 0  undocumented statuses: none" in out
    assert "daemon RSS:" in out and "INVALID_ARGUMENT" in out


def test_a_status_the_table_does_not_document_or_a_dead_daemon_fails_the_run(tmp_path: Path) -> None:
    proc = fuzz._start_daemon(tmp_path)
    try:
        sock = str(tmp_path / "kv.sock")
        documented = fuzz.documented_statuses((fuzz.ROOT / "README.md").read_text())
        documented["Lookup"] = frozenset({"OK"})
        report = fuzz.run(sock, 200, 3, 10.0, documented, fuzz.stats_check(sock), every=50)
        assert not report.ok and {m for m, _ in report.undocumented} == {"Lookup"}
        assert report.rss_before > 0 and report.rss_after > 0 and not report.crashed

        def kill_once() -> None:   # the daemon dies between two batches
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        report = fuzz.run(sock, 200, 4, 10.0, documented, kill_once, every=50)
        assert report.crashed and report.requests == 100 and not report.ok
        assert "crashes: 1" in report.text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
