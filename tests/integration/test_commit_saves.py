"""``save`` in one call: the SDK copies the rows into its session's spare slots, then one Commit
names the blocks (README, "Which calls take which path"). Real daemons, both transports."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import numpy as np
import pytest

import kvstored
from conftest import Daemon, wait_serving
from kvstored_client.presence import PresenceReader

Factory = Callable[..., Daemon]
BLOCK = 16
WIDTH = 4096


def prompt(i: int, blocks: int) -> np.ndarray:
    return np.arange(blocks * BLOCK) + i * 1_000_000


def rows(i: int, blocks: int, width: int = WIDTH) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (blocks, width), np.uint8)


def start_again(d: Daemon, c: kvstored.Client, tokens: np.ndarray) -> None:
    """Start the stopped daemon ``d`` over its state and wait until ``c`` reaches it again."""
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(d.args, stdout=log, stderr=subprocess.STDOUT)
    wait_serving(d.socket, d.proc)
    for _ in range(40):
        try:
            c.lookup(tokens)
            return
        except kvstored.DaemonNotRunning:
            time.sleep(0.1)


def test_saves_after_the_first_take_one_call_and_store_what_reserve_and_seal_stored(client) -> None:  # type: ignore[no-untyped-def]
    c: kvstored.Client = client
    first = c.save(prompt(0, 2), rows(0, 2))   # the namespace's block size is fixed by this one
    assert (first.present, first.stored) == (0, 2)
    for i, n in enumerate((1, 3, 40), start=1):
        before = c.committed_saves
        got = c.save(prompt(i, n), rows(i, n))
        assert (got.present, got.stored) == (0, n) and c.committed_saves == before + 1
        assert np.array_equal(c.load(prompt(i, n)).data, rows(i, n))
    # a longer prompt over a cached one: only the new blocks' rows are stored
    longer = np.concatenate([prompt(3, 40), prompt(50, 5)])
    want = np.concatenate([rows(3, 40), rows(50, 5)])
    got = c.save(longer, want)
    assert (got.present, got.stored) == (40, 5)
    assert np.array_equal(c.load(longer).data, want)
    # with start: the rows of blocks start.. only; a first block not cached stores nothing
    p = prompt(60, 6)
    c.save(p[: 2 * BLOCK], rows(60, 6)[:2])
    got = c.save(p, rows(60, 6)[2:], start=2)
    assert (got.present, got.stored) == (2, 4) and np.array_equal(c.load(p).data, rows(60, 6))
    got = c.save(prompt(61, 4), rows(61, 4)[2:], start=2)
    assert (got.present, got.stored) == (0, 0) and c.lookup(prompt(61, 4)).blocks == 0


def test_saves_through_a_full_tier_keep_every_byte_and_leak_no_slot(daemon_factory: Factory) -> None:
    """Thousands of one-call saves into a DRAM tier that holds 64 blocks: every save stores its
    blocks, what is still cached reads back as saved, and the spare slots the session held come
    back once it ended and their quarantine (``dram.quarantine_s``) is over (the tier's used bytes are
    its blocks' again)."""
    d = daemon_factory("--dram-capacity", "16MiB", "--set", "ssd.enabled=false", "--set", "dram.page_bytes=1MiB",
                       "--set", "dram.quarantine_s=0.5", "--set", "leases.reap_interval_s=0.1")
    width = 256 << 10
    with kvstored.Client(d.socket) as c:
        for i in range(300):
            n = 1 + i % 3
            assert c.save(prompt(i, n), rows(i, n, width)).stored == n
            if i % 25 == 0:
                for j in range(max(0, i - 5), i + 1):
                    m = 1 + j % 3
                    got = c.load(prompt(j, m))
                    assert got.blocks in (0, m) and (got.blocks == 0 or np.array_equal(got.data, rows(j, m, width)))
        assert c.committed_saves >= 299
        held = c.stats()["tiers"][0]
    with kvstored.Client(d.socket) as other:
        for _ in range(100):
            after = other.stats()["tiers"][0]
            if after["used_bytes"] == after["blocks"] * width:
                break
            time.sleep(0.05)
        assert after["used_bytes"] == after["blocks"] * width, (held, after)


def test_a_daemon_without_spares_saves_through_reserve_and_seal(daemon_factory: Factory) -> None:
    d = daemon_factory("--set", "dram.spare_bytes=0")
    with kvstored.Client(d.socket) as c:
        for i in range(3):
            assert c.save(prompt(i, 3), rows(i, 3)).stored == 3
            assert np.array_equal(c.load(prompt(i, 3)).data, rows(i, 3))
        assert c.committed_saves == 0


def test_a_block_the_table_showed_cached_but_that_left_is_still_saved(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK copies rows only for the blocks after those the presence table shows cached; when
    one of those left before the Commit (evicted meanwhile), the Commit stores nothing and the save
    goes again through a reservation, which takes every row."""
    with kvstored.Client(daemon.socket) as c:
        c.save(prompt(0, 1), rows(0, 1))   # the block size, and the session's spares
        c.save(prompt(1, 1), rows(1, 1))
        assert c.committed_saves == 1
        monkeypatch.setattr(PresenceReader, "lookup", lambda self, ns, packed, size: (2, 0))
        got = c.save(prompt(2, 4), rows(2, 4))
        assert (got.present, got.stored) == (0, 4) and c.committed_saves == 1
        monkeypatch.undo()
        assert np.array_equal(c.load(prompt(2, 4)).data, rows(2, 4))


def test_a_client_saving_across_a_daemon_restart_never_writes_the_old_sessions_slots(
        daemon_factory: Factory) -> None:
    d = daemon_factory()
    c = kvstored.Client(d.socket)
    for i in range(3):
        c.save(prompt(i, 2), rows(i, 2))
    assert d.stop() == 0
    start_again(d, c, prompt(0, 2))
    for i in range(3, 8):
        assert c.save(prompt(i, 2), rows(i, 2)).stored == 2
    for i in range(8):   # the first three came back from SSD, the others are new
        assert np.array_equal(c.load(prompt(i, 2)).data, rows(i, 2)), i
    assert c.committed_saves >= 5
    c.close()


def test_saves_that_do_not_wait_are_seen_by_the_next_call_and_by_other_clients_once_answered(
        daemon: Daemon) -> None:
    """``save(wait=False)``: the Commit is sent and the save returns; this client's next lookup
    or load reads the answers first (so sees the blocks), another client sees them once the
    daemon served them (``wait_saves``). A continuation sent behind its prefix (``start``) is
    served after it, on the same connection."""
    with kvstored.Client(daemon.socket) as c, kvstored.Client(daemon.socket) as other:
        c.save(prompt(0, 1), rows(0, 1))   # the block size, and the spares
        for i in range(1, 30):
            n = 1 + i % 4
            got = c.save(prompt(i, n), rows(i, n), wait=False)
            assert (got.present, got.stored) == (0, n)
        p = prompt(40, 6)
        c.save(p[: 3 * BLOCK], rows(40, 6)[:3], wait=False)
        c.save(p, rows(40, 6)[3:], start=3, wait=False)
        assert c.lookup(p).blocks == 6 and np.array_equal(c.load(p).data, rows(40, 6))
        c.wait_saves()
        for i in range(1, 30):
            n = 1 + i % 4
            assert np.array_equal(other.load(prompt(i, n)).data, rows(i, n)), i
        assert c.committed_saves == 31 and c.lost_saved_blocks == 0 and c.save_errors == 0


def test_saves_that_do_not_wait_read_only_the_oldest_answer_when_the_spares_run_out(daemon: Daemon) -> None:
    """The spares hold four saves' worth: the fifth save in a row waits for slots. It read every
    answer owed, so every fourth save stopped until the daemon had served all the others (the
    daemon then idle while the client copied the next rows); it reads the oldest answer only,
    whose slots it needs, and the other saves stay in flight."""
    with kvstored.Client(daemon.socket) as c:
        c.save(prompt(0, 4), rows(0, 4))   # the block size
        depth = []
        for i in range(1, 25):
            assert c.save(prompt(i, 4), rows(i, 4), wait=False).stored == 4
            depth.append(c.saves_in_flight)
        assert depth[:4] == [1, 2, 3, 4] and min(depth[4:]) == 4, depth
        c.wait_saves()
        assert c.saves_in_flight == 0 and c.lost_saved_blocks == 0 and c.committed_saves == 24
        for i in range(1, 25):
            assert np.array_equal(c.load(prompt(i, 4)).data, rows(i, 4)), i


def test_a_save_that_did_not_wait_and_stored_nothing_is_counted_not_raised(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    with kvstored.Client(daemon.socket) as c:
        c.save(prompt(0, 1), rows(0, 1))
        monkeypatch.setattr(PresenceReader, "lookup", lambda self, ns, packed, size: (2, 0))
        got = c.save(prompt(1, 5), rows(1, 5), wait=False)   # rows for blocks 2.. only: a hole
        assert (got.present, got.stored) == (2, 3)
        monkeypatch.undo()
        c.wait_saves()
        assert c.lost_saved_blocks == 3 and c.save_errors == 0 and c.lookup(prompt(1, 5)).blocks == 0
        assert c.save(prompt(1, 5), rows(1, 5)).stored == 5   # saved again, waiting: all there
        assert np.array_equal(c.load(prompt(1, 5)).data, rows(1, 5))


def test_a_save_that_did_not_wait_on_a_daemon_that_went_away_is_counted_and_the_client_goes_on(
        daemon_factory: Factory) -> None:
    d = daemon_factory()
    c = kvstored.Client(d.socket, timeout_s=10)
    c.save(prompt(0, 1), rows(0, 1))
    c.save(prompt(3, 1), rows(3, 1))   # (one call: the session holds spares now)
    os.kill(d.proc.pid, signal.SIGSTOP)   # the Commit is sent into the socket, never answered
    got = c.save(prompt(1, 2), rows(1, 2), wait=False)
    assert got.stored == 2
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(kvstored.DaemonNotRunning):   # the call reads the answer first: there is none
        c.stats()
    assert (c.save_errors, c.lost_saved_blocks) == (1, 2)
    assert isinstance(c.last_save_error, kvstored.DaemonNotRunning)
    start_again(d, c, prompt(0, 1))
    assert c.save(prompt(2, 2), rows(2, 2), wait=False).stored == 2
    assert np.array_equal(c.load(prompt(2, 2)).data, rows(2, 2))
    c.close()


def test_over_grpc_a_save_that_does_not_wait_still_waits(daemon: Daemon) -> None:
    with kvstored.Client(daemon.socket, fast_path=False) as c:
        c.save(prompt(0, 1), rows(0, 1))
        assert c.save(prompt(1, 3), rows(1, 3), wait=False).stored == 3 and c.committed_saves == 1
        with kvstored.Client(daemon.socket) as other:
            assert np.array_equal(other.load(prompt(1, 3)).data, rows(1, 3))


def test_streams_and_flushes_come_after_the_saves_that_did_not_wait(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a flush, stream, pull or migration is a gRPC stream, not a fast-path call: it too
    reads the answers of the saves sent before it first (else a flush could miss their blocks)."""
    with kvstored.Client(daemon.socket) as c:
        c.save(prompt(0, 1), rows(0, 1))
        settled: list[int] = []
        assert c._write_behind is not None
        real = c._write_behind.settle
        monkeypatch.setattr(c._write_behind, "settle", lambda: (settled.append(len(c._write_behind)), real())[1])
        for i in range(1, 4):
            c.save(prompt(i, 2), rows(i, 2), wait=False)
        assert c.flush() == 7 and settled and settled[0] == 3
        c.save(prompt(9, 2), rows(9, 2), wait=False)
        handle = c.stream(prompt(9, 2))
        got = [np.asarray(b.data) for b in handle]
        assert len(got) == 2 and np.array_equal(np.stack(got), rows(9, 2))


def test_a_save_over_the_batch_limit_is_refused_before_any_row_is_copied(daemon_factory: Factory) -> None:
    """Review: a chain longer than server.max_batch_blocks went to a Commit after its rows were
    copied into spare slots; the daemon refused it and the slots were lost to the session."""
    d = daemon_factory("--set", "server.max_batch_blocks=8")
    with kvstored.Client(d.socket) as c:
        c.save(prompt(0, 1), rows(0, 1))
        for wait in (True, False):
            with pytest.raises(kvstored.InvalidArgument):
                c.save(prompt(1, 10), rows(1, 10), wait=wait)
        for i in range(2, 40):   # the spares are all still there: every save one call
            assert c.save(prompt(i, 8), rows(i, 8)).stored == 8
        assert c.committed_saves == 38
