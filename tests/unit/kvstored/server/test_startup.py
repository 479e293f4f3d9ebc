"""Start-up progress told to systemd and the log: every step at once, advances rate-limited, and
always with a timeout extension, so that a long restore is not killed by TimeoutStartSec."""

from __future__ import annotations

import logging

import pytest
from clock import Clock

from kvstored.server import startup
from kvstored.server.startup import StartupProgress


def _reporter() -> tuple[StartupProgress, Clock, list[str]]:
    clock, sent = Clock(), []
    return StartupProgress(clock=clock, notify=sent.append), clock, sent


def test_a_step_is_told_at_once_with_an_extension_that_covers_it(caplog: pytest.LogCaptureFixture) -> None:
    progress, _, sent = _reporter()
    with caplog.at_level(logging.INFO, logger="kvstored"):
        progress.step("opening the DRAM tier")
        progress.step("pre-faulting 512 GiB", expect_s=550.0)
    assert sent == [f"STATUS=starting: opening the DRAM tier\nEXTEND_TIMEOUT_USEC={int(startup.EXTEND_S * 1e6)}",
                    "STATUS=starting: pre-faulting 512 GiB\nEXTEND_TIMEOUT_USEC=550000000"]
    assert "starting: opening the DRAM tier" in caplog.text and "starting: pre-faulting 512 GiB" in caplog.text


def test_advances_are_told_at_most_once_a_second_and_logged_every_ten(caplog: pytest.LogCaptureFixture) -> None:
    progress, clock, sent = _reporter()
    with caplog.at_level(logging.INFO, logger="kvstored"):
        progress.step("restoring")
        for i in range(1, 1001):          # 25 s of records, one every 25 ms
            clock.now += 0.025
            progress.advance(i * 100, 100_000)
    advances = sent[1:]
    assert 20 <= len(advances) <= 26, advances
    assert all(m.endswith(f"EXTEND_TIMEOUT_USEC={int(startup.EXTEND_S * 1e6)}") for m in advances)
    assert advances[-1].startswith("STATUS=starting: restoring: ") and " of 100,000" in advances[-1]
    logged = [r.getMessage() for r in caplog.records if "restoring:" in r.getMessage()]
    assert 2 <= len(logged) <= 3, logged      # at 10 s and 20 s (and not per advance)


def test_report_starts_a_new_step_when_what_changes() -> None:
    progress, clock, sent = _reporter()
    progress.report("reading records", 4096)
    clock.now += 2
    progress.report("reading records", 8192)
    progress.report("indexing", 4096, 8192)     # a new step: told at once
    assert [m.split("\n")[0] for m in sent] == [
        "STATUS=starting: reading records", "STATUS=starting: reading records: 8,192",
        "STATUS=starting: indexing"]


def test_a_stop_asked_for_ends_the_start_at_its_next_step_or_advance() -> None:
    progress, _, sent = _reporter()
    progress.step("restoring blocks from SSD: indexing")
    progress.advance(10, 100)
    progress.request_stop()
    with pytest.raises(startup.StartupStopped, match=r"stopped while starting \(restoring blocks from SSD"):
        progress.advance(20, 100)
    with pytest.raises(startup.StartupStopped):
        progress.step("joining the cluster")
    assert len(sent) == 1   # nothing told to systemd once the stop was asked for
