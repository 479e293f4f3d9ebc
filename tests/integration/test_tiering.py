"""DRAM <-> SSD with a real daemon and real LMDB: demotion, promotion, prefetch, restart,
kill -9, disk full, corruption, churn, kvctl evict/flush."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvstored
from conftest import Daemon, start_daemon
from fsprobe import can_punch_holes

WIDTH = 256 << 10  # bytes per block: the 64 MiB test arena holds 256


def content(tokens: np.ndarray, width: int = WIDTH) -> np.ndarray:
    """Block rows that are a function of each block's key, so any block read back can be checked."""
    keys = kvstored.block_hashes(tokens)
    return np.stack([np.random.default_rng(int.from_bytes(k[:8], "little")).integers(
        0, 255, size=width, dtype=np.uint8) for k in keys])


def prompt(i: int, blocks: int = 16) -> np.ndarray:
    return np.arange(16 * blocks) + 1_000_000 * (i + 1)


def wait_for(cond, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_overflow_goes_to_ssd_and_loads_back(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket) as c:
        for i in range(40):  # 640 blocks of 256 KiB through a 256-block arena
            c.save(prompt(i), content(prompt(i)))
        st = c.stats()
        dram, ssd = st["tiers"]
        assert dram["used_bytes"] <= dram["capacity_bytes"] and st["demotions"] > 0
        assert ssd["blocks"] > 0 and ssd["used_bytes"] <= ssd["capacity_bytes"]
        first = c.lookup(prompt(0))
        assert first.blocks == 16 and first.per_tier.get("ssd", 0) > 0
        res = c.load(prompt(0))  # no prefetch needed
        assert res.blocks == 16 and np.array_equal(res.data, content(prompt(0)))
        assert c.lookup(prompt(0)).per_tier == {"dram": 16}  # promoted
        assert c.stats()["promotions"] >= first.per_tier["ssd"]


def test_prefetch_promotes_ahead_of_load(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket) as c:
        for i in range(40):
            c.save(prompt(i), content(prompt(i)))
        assert c.evict(tier="dram") > 0
        started = c.prefetch(prompt(5))
        assert started.blocks == 16 and started.per_tier == {"promoting": 16}
        assert wait_for(lambda: c.lookup(prompt(5)).per_tier == {"dram": 16})
        assert np.array_equal(c.load(prompt(5)).data, content(prompt(5)))
        # a plain lookup that hits SSD starts the promotion by itself
        c.evict(tier="dram")
        assert c.lookup(prompt(6)).per_tier == {"ssd": 16}
        assert wait_for(lambda: c.lookup(prompt(6)).per_tier == {"dram": 16})


def test_admission_never_keeps_ssd_empty(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--set", "ssd.admission=never")
    with kvstored.Client(d.socket) as c:
        for i in range(24):
            c.save(prompt(i), content(prompt(i)))
        st = c.stats()
        assert st["demotions"] == 0 and st["tiers"][1]["blocks"] == 0 and st["dropped_blocks"] > 0
        assert c.lookup(prompt(0)).blocks == 0


def test_hit_before_admission_writes_only_reused_blocks(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--set", "ssd.admission=hit_before")
    with kvstored.Client(d.socket) as c:
        c.save(prompt(0), content(prompt(0)))
        c.lookup(prompt(0))  # reused once: worth keeping
        for i in range(1, 24):
            c.save(prompt(i), content(prompt(i)))
        assert c.lookup(prompt(0)).blocks == 16
        assert c.lookup(prompt(1)).blocks == 0  # used once, dropped rather than written down
        assert np.array_equal(c.load(prompt(0)).data, content(prompt(0)))


def test_clean_restart_serves_ssd_blocks(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    with kvstored.Client(d.socket) as c:
        for i in range(6):
            c.save(prompt(i), content(prompt(i)))
        assert c.flush() == 6 * 16
    assert d.stop() == 0
    again = start_daemon(tmp_path)
    try:
        assert "restored 96 block(s)" in again.log()
        with kvstored.Client(again.socket) as c:
            for i in range(6):
                assert c.lookup(prompt(i)).per_tier == {"ssd": 16}
                assert np.array_equal(c.load(prompt(i)).data, content(prompt(i)))
            # a longer prompt over a restored prefix stores only its tail
            longer = np.concatenate([prompt(0), np.arange(32) + 5])
            assert c.save(longer, content(longer)).stored == 2
    finally:
        again.stop()


WRITER = """
import sys, time, numpy as np, kvstored
sys.path.insert(0, {tests!r})
from integration.test_tiering import content, prompt
c = kvstored.Client({socket!r})
i = {start}
stop = time.monotonic() + 60   # bounded: the test kills the daemon (and us) within seconds
while time.monotonic() < stop:
    p = prompt(i, 4)
    c.save(p, content(p))
    print(i, flush=True)
    i += 1
"""


def test_kill_9_during_sustained_writes(tmp_path: Path) -> None:
    """Killed at random moments while writing: every block found afterwards is exactly what was
    written, and nothing half-written is visible."""
    rng = random.Random(1234)
    tests_dir = str(Path(__file__).resolve().parent.parent)
    written = 0
    # A tiny write-back watermark keeps the writer thread committing all the time.
    extra = ("--set", "dram.writeback_watermark=0.05")
    for round_ in range(3):
        d = start_daemon(tmp_path, *extra)
        code = WRITER.format(tests=tests_dir, socket=d.socket, start=written)
        writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None
            deadline = time.monotonic() + rng.uniform(1.0, 3.0)
            last = written
            while time.monotonic() < deadline:
                line = writer.stdout.readline()
                if not line:
                    break
                last = int(line)
            d.stop(signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait(10)
        written = last + 1
        assert written > 0, f"round {round_}: nothing was written"
    d = start_daemon(tmp_path)
    try:
        with kvstored.Client(d.socket) as c:
            found = 0
            for i in range(written + 5):
                p = prompt(i, 4)
                res = c.load(p)
                assert np.array_equal(res.data, content(p)[: res.blocks]), f"prompt {i} corrupt"
                found += res.blocks
            assert found > 0
            assert c.stats()["tiers"][1]["read_errors"] == 0
    finally:
        d.stop()


def start_with_block_1_corrupted(tmp_path: Path) -> tuple[Daemon, np.ndarray, np.ndarray]:
    """A daemon restarted over a 3-block prompt whose block 1 has a byte flipped on disk."""
    d = start_daemon(tmp_path)
    marker = np.full(WIDTH, 0x5A, dtype=np.uint8)
    marker[:16] = np.frombuffer(b"CORRUPT-ME-BLOCK", dtype=np.uint8)
    p = prompt(0, 3)
    rows = content(p)
    rows[1] = marker  # block 1 carries a pattern we can find on disk
    with kvstored.Client(d.socket) as c:
        c.save(p, rows)
        assert c.flush() == 3
    assert d.stop() == 0
    data = Path(tmp_path) / "kv-ssd" / f"payload-{WIDTH}.dat"
    blob = bytearray(data.read_bytes())
    at = blob.find(b"CORRUPT-ME-BLOCK")
    assert at >= 0
    blob[at + 5000] ^= 0xFF
    data.write_bytes(bytes(blob))
    return start_daemon(tmp_path), p, rows


def test_corrupted_value_is_a_miss_and_dropped(tmp_path: Path) -> None:
    again, p, rows = start_with_block_1_corrupted(tmp_path)
    try:
        with kvstored.Client(again.socket) as c:
            res = c.load(p)
            assert res.blocks == 1 and np.array_equal(res.data[0], rows[0])  # a miss from block 1 on
            st = c.stats()
            assert st["tiers"][1]["read_errors"] == 1 and st["dropped_blocks"] >= 1
            assert c.lookup(p).blocks == 1  # the block is gone, not served again
            c.save(p, rows)  # and can be stored again
            again_loaded = c.load(p)
            assert again_loaded.blocks == 3 and np.array_equal(again_loaded.data, rows)
    finally:
        again.stop()


def test_evict_after_a_corrupt_interior_block_empties_the_index(tmp_path: Path) -> None:
    """Regression: the hollow block 1 left the index with its last child during ``evict``, which
    then tried to remove it again (AssertionError, and kvctl evict failed)."""
    again, p, _ = start_with_block_1_corrupted(tmp_path)
    try:
        with kvstored.Client(again.socket) as c:
            assert c.load(p).blocks == 1
            assert c.evict() == 2   # blocks 0 and 2; the hollow block 1 goes with block 2
            assert c.stats()["index_blocks"] == 0 and c.lookup(p).blocks == 0
    finally:
        again.stop()


def test_churn_of_3x_capacity_stays_under_capacity(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--ssd-capacity", "32MiB", "--set", "dram.writeback_watermark=0.1")
    with kvstored.Client(d.socket) as c:
        for i in range(60):  # 60 x 16 x 256 KiB = 240 MiB through 64 MiB DRAM + 32 MiB SSD
            c.save(prompt(i), content(prompt(i)))
            ssd = c.stats()["tiers"][1]
            assert ssd["used_bytes"] <= ssd["capacity_bytes"]
        st = c.stats()
        assert st["tiers"][1]["evictions"] > 0
        assert c.lookup(prompt(59)).blocks == 16
    payload = Path(d.socket).parent / "kv-ssd" / f"payload-{WIDTH}.dat"
    # Freed slots are reused, so the file stays near capacity: at most the slots whose deletes were
    # still queued (one write-back round, the gap between the watermarks) beyond it.
    assert payload.stat().st_size <= int(1.25 * (32 << 20))


def test_a_model_change_keeps_the_ssd_files_near_capacity(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The slot files of a block size gave disk space back only at their end, so while a model
    with another block size replaced the cached one, the old size's file stayed at its largest
    beside the new one's: up to twice ssd.capacity on disk (a README known limit). Free slots
    are punched out now, and the tier's files stay near capacity all through the change (1.75x
    ssd.capacity at their peak before, 1.09x now). Deterministic: the old model's blocks are on
    SSD alone and each new prompt is flushed, so the write-back's timing plays no part (the SSD
    tier evicts only blocks it alone holds)."""
    capacity = 32 << 20
    d = daemon_factory("--ssd-capacity", "32MiB", "--set", "dram.writeback_watermark=0.1")
    ssd_dir = Path(d.socket).parent / "kv-ssd"
    if not can_punch_holes(ssd_dir):
        pytest.skip("the test directory's filesystem cannot punch holes")
    old, new = kvstored.Namespace(model="old"), kvstored.Namespace(model="new")
    half = WIDTH // 2

    def payload_disk_bytes() -> int:
        return sum(f.stat().st_blocks * 512 for f in ssd_dir.glob("payload-*.dat"))

    with kvstored.Client(d.socket) as c:
        for i in range(7):   # 28 MiB of the old model's blocks, on SSD alone
            c.save(prompt(i), content(prompt(i)), namespace=old)
        c.flush("old")
        c.evict("old", tier="dram")
        assert c.stats()["tiers"][1]["used_bytes"] == 28 << 20
        peak = 0
        for i in range(14):   # 28 MiB of the new model's (blocks half as large) replace them
            c.save(prompt(100 + i), content(prompt(100 + i), half), namespace=new)
            c.flush("new")   # on SSD now, not when the write-back gets to it (saves outran it)
            peak = max(peak, payload_disk_bytes())
        # (no lookup of the old model's prompts: a hit would earn its blocks credit over the new ones)
        ssd = c.stats()["tiers"][1]
        assert ssd["evictions"] >= 64, f"the old model's blocks did not leave the SSD tier: {ssd}"
        assert np.array_equal(c.load(prompt(113), namespace=new).data, content(prompt(113), half))
    assert peak <= 1.3 * capacity, f"the payload files took {peak / capacity:.2f}x ssd.capacity on disk"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_disk_full_keeps_serving_and_recovers(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        filler = mnt / "filler"
        d = start_daemon(tmp_path / "d", "--ssd-path", str(mnt / "ssd"), "--ssd-capacity", "64MiB",
                         "--set", "dram.writeback_watermark=0.05")
        with open(filler, "wb") as fh:  # leave almost nothing free
            fh.write(b"\0" * (22 << 20))
        try:
            with kvstored.Client(d.socket) as c:
                for i in range(12):
                    c.save(prompt(i), content(prompt(i)))
                assert wait_for(lambda: c.stats()["tiers"][1]["write_errors"] > 0)
                assert d.proc.poll() is None
                assert np.array_equal(c.load(prompt(11)).data, content(prompt(11)))  # DRAM still serves
                filler.unlink()  # space returns
                before = c.stats()["demotions"]
                for i in range(12, 20):
                    c.save(prompt(i), content(prompt(i)))
                assert wait_for(lambda: c.stats()["demotions"] > before), "writes did not resume:\n" + d.log()
        finally:
            d.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_kvctl_evict_and_flush(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("--set", "ssd.max_dirty_s=3600")   # nothing written before the flush
    with kvstored.Client(daemon.socket) as c:
        for i in range(3):
            c.save(prompt(i), content(prompt(i)), namespace=kvstored.Namespace(model="a"))
        c.save(prompt(9), content(prompt(9)), namespace=kvstored.Namespace(model="b"))
    env = {**os.environ, "KVSTORED_SOCKET": daemon.socket}

    def kvctl(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "kvstored.kvctl", *args], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "flushed 48 block(s)" in kvctl("flush", "--model", "a")
    assert "evicted 48 block(s) of a from dram" in kvctl("evict", "--model", "a", "--tier", "dram")
    with kvstored.Client(daemon.socket) as c:
        assert c.lookup(prompt(0), namespace=kvstored.Namespace(model="a")).per_tier == {"ssd": 16}
        assert c.lookup(prompt(9), namespace=kvstored.Namespace(model="b")).per_tier == {"dram": 16}
    assert "evicted 64 block(s) from the cache (every tier)" in kvctl("evict")
    with kvstored.Client(daemon.socket) as c:
        assert c.lookup(prompt(0), namespace=kvstored.Namespace(model="a")).blocks == 0
    table = kvctl("stats")   # and stats still renders: both tiers, nothing left in the index
    assert "dram" in table and "ssd" in table, table
    assert re.search(r"index blocks\s+0\s*$", table, re.M), table


def test_a_flush_longer_than_the_client_timeout_completes_and_shows_progress(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Was: Flush was one unary call under the client's timeout_s (30 s by default), so `kvctl
    flush` of an arena that takes longer to write (a few tens of GiB here) was cancelled midway
    with DeadlineExceeded, and showed nothing meanwhile. Flushing now streams progress; the
    client gives up only after a silence."""
    d = daemon_factory("--dram-capacity", "256MiB", "--ssd-capacity", "512MiB",
                       "--set", "dram.writeback_watermark=1.0",   # nothing written before the flush
                       "--set", "ssd.max_dirty_s=3600")
    with kvstored.Client(d.socket) as c:
        for i in range(60):                       # 960 blocks of 256 KiB: 240 MiB
            c.save(prompt(i), content(prompt(i)))
        c._timeout = 0.01                         # a flush that takes longer than the client's timeout_s
        progress = list(c.flushing())
        c._timeout = 30.0
        assert progress[0] == {"written_blocks": 0, "left_blocks": 960, "done": False}
        assert progress[-1] == {"written_blocks": 960, "left_blocks": 0, "done": True}
        written = [p["written_blocks"] for p in progress]
        assert written == sorted(written) and len(progress) > 2, progress   # one report per write round
        assert all(p["written_blocks"] + p["left_blocks"] == 960 for p in progress)
        assert c.stats()["tiers"][1]["blocks"] == 960
        c.save(prompt(99), content(prompt(99)))
    out = subprocess.run([sys.executable, "-m", "kvstored.kvctl", "flush"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KVSTORED_SOCKET": d.socket})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "flushed 16 block(s) to ssd\n"
    assert "flushing to ssd" in out.stderr and "16/16" in out.stderr   # the progress bar


def test_kvctl_flush_fails_when_blocks_stay_dram_only(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Regression: ``kvctl flush`` said "flushed N" and exited 0 while blocks it could not write
    (the SSD tier too small) stayed in DRAM only, to be lost at the restart it was run for."""
    d = daemon_factory("--ssd-capacity", "2MiB", "--set", "dram.writeback_watermark=1.0")
    with kvstored.Client(d.socket) as c:
        c.save(prompt(0), content(prompt(0)))   # 16 blocks of 256 KiB: 4 MiB
    out = subprocess.run([sys.executable, "-m", "kvstored.kvctl", "flush"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KVSTORED_SOCKET": d.socket})
    assert out.returncode == 1
    assert "still only in DRAM" in out.stderr and "wrote" in out.stderr


def test_a_lowered_ssd_capacity_holds_from_the_restart_on(tmp_path: Path) -> None:
    """Regression: restarting with a smaller ssd.capacity left the tier over it (400% used) until
    some later write made room."""
    d = start_daemon(tmp_path, "--ssd-capacity", "32MiB")
    with kvstored.Client(d.socket) as c:
        for i in range(4):
            c.save(prompt(i), content(prompt(i)))   # 4 x 16 x 256 KiB = 16 MiB
        assert c.flush() == 64
    assert d.stop() == 0
    again = start_daemon(tmp_path, "--ssd-capacity", "4MiB")
    try:
        with kvstored.Client(again.socket) as c:
            ssd = c.stats()["tiers"][1]
            assert 0 < ssd["used_bytes"] <= ssd["capacity_bytes"] == 4 << 20
            assert c.lookup(prompt(3)).blocks > 0 or c.lookup(prompt(0)).blocks > 0   # what is left serves
        assert "to fit ssd.capacity" in again.log()
    finally:
        again.stop()


def test_sigterm_writes_dram_only_blocks_before_exiting(tmp_path: Path) -> None:
    """`systemctl restart kvstored` (SIGTERM, exit 0, restart) kept only what write-back had
    already put on SSD: every block saved since, up to dram.writeback_watermark of the arena
    (6 GiB of the example config's 8 GiB), was dropped without a word in the log."""
    d = start_daemon(tmp_path)
    with kvstored.Client(d.socket) as c:
        for i in range(3):   # 48 blocks of 256 KiB: 12 MiB, under the 75% write-back watermark
            c.save(prompt(i), content(prompt(i)))
        assert c.stats()["tiers"][1]["blocks"] == 0   # nothing written back yet
    assert d.stop() == 0
    again = start_daemon(tmp_path)
    try:
        with kvstored.Client(again.socket) as c:
            for i in range(3):
                assert c.lookup(prompt(i)).blocks == 16, d.log()[-2000:]
                assert np.array_equal(c.load(prompt(i)).data, content(prompt(i)))
    finally:
        again.stop()
