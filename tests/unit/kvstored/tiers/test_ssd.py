"""The LMDB tier on its own: round trip, checksums, scan, full map, group commit."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash

from fsprobe import can_punch_holes
from kvstored.tiers.ssd import BlockRecord, Corrupt, InUse, MapFull, SSDError, SSDTier


def payload(seed: int, n: int = 64 << 10) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=n, dtype=np.uint8)


def test_round_trip_and_scan(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        futures = [ssd.put(7, bytes([i]) * 32, bytes([i - 1]) * 32 if i else b"", i, payload(i)) for i in range(5)]
        for f in futures:
            f.result(10)
        out = np.empty(64 << 10, dtype=np.uint8)
        ssd.read_into(7, bytes([3]) * 32, out).result(10)
        assert np.array_equal(out, payload(3))
        records = sorted((r for r in ssd.scan() if isinstance(r, BlockRecord)), key=lambda r: r.depth)
        assert [r.depth for r in records] == [0, 1, 2, 3, 4]
        assert records[2].parent == bytes([1]) * 32 and records[2].length == 64 << 10
        ssd.delete(7, bytes([4]) * 32).result(10)
        assert len(list(ssd.scan())) == 4
    finally:
        ssd.close()


def test_corrupt_payload_is_reported_not_returned(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        ssd.put(1, b"k" * 32, b"", 0, payload(1)).result(10)
        data = tmp_path / f"payload-{64 << 10}.dat"
        with open(data, "r+b") as fh:  # flip one byte behind the tier's back
            fh.seek(1000)
            byte = fh.read(1)
            fh.seek(1000)
            fh.write(bytes([byte[0] ^ 0xFF]))
        out = np.zeros(64 << 10, dtype=np.uint8)
        with pytest.raises(Corrupt, match="checksum"):
            ssd.read_into(1, b"k" * 32, out).result(10)
        with pytest.raises(Corrupt, match="bytes"):
            ssd.read_into(1, b"k" * 32, np.zeros(10, dtype=np.uint8)).result(10)
        with pytest.raises(Corrupt, match="missing"):
            ssd.read_into(1, b"x" * 32, out).result(10)
        assert ssd.checksum_failures == 1
    finally:
        ssd.close()


def test_full_index_map_fails_cleanly(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 0)  # the smallest index map
    ssd._env.set_mapsize(64 << 10)
    try:
        # One put at a time, each its own commit: queued all at once, a writer that started late
        # (a loaded machine) took them as one group commit that failed whole, with no "ok"
        outcomes: list[str] = []
        for i in range(2000):
            try:
                ssd.put(1, bytes([i % 256, i // 256]) * 16, b"p" * 32, 0, payload(i, 4096)).result(30)
                outcomes.append("ok")
            except MapFull:
                outcomes.append("full")
                if outcomes.count("full") == 3:
                    break
        assert "ok" in outcomes and "full" in outcomes
        stored = {r.key for r in ssd.scan() if isinstance(r, BlockRecord)}
        assert len(stored) == outcomes.count("ok")  # what failed left nothing behind
    finally:
        ssd.close()


def test_slots_are_reused_after_delete_and_survive_reopen(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20)
    for i in range(8):
        ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
    for i in range(4):
        ssd.delete(1, bytes([i]) * 32).result(10)
    for i in range(8, 12):
        ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
    size = (tmp_path / f"payload-{64 << 10}.dat").stat().st_size
    assert size <= 8 * (64 << 10)  # the freed slots were taken again, the file did not grow
    ssd.close()
    again = SSDTier(str(tmp_path), 64 << 20)
    try:
        out = np.empty(64 << 10, dtype=np.uint8)
        for i in range(4, 12):
            again.read_into(1, bytes([i]) * 32, out).result(10)
            assert np.array_equal(out, payload(i))
        again.put(1, b"z" * 32, b"", 0, payload(99)).result(10)  # a new slot, not a live one
        for i in range(4, 12):
            again.read_into(1, bytes([i]) * 32, out).result(10)
            assert np.array_equal(out, payload(i))
    finally:
        again.close()


def test_payload_files_give_back_the_disk_space_of_slots_nobody_uses(tmp_path: Path) -> None:
    """Slot files only ever grew: a block size whose blocks had all left (a model no longer served,
    ``kvctl evict``, a lowered ssd.capacity or a config that refuses a namespace at restart) kept
    its file at its largest for good, beside the files of the sizes in use, so the tier's files
    took far more disk than ssd.capacity and a disk sized for it filled up (every write then
    failing for ever: the space was the daemon's own). A size with no block left gives its file's
    space back; at open, each file is cut to its highest used slot, and one with no record goes."""
    big, small = 64 << 10, 4096
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        for i in range(8):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
        for i in range(8):
            ssd.delete(1, bytes([i]) * 32).result(10)
        data = tmp_path / f"payload-{big}.dat"
        assert data.stat().st_blocks == 0, f"a size with no block left keeps {data.stat().st_blocks * 512} bytes"
        ssd.put(1, b"n" * 32, b"", 0, payload(8)).result(10)   # and the size is written again
        out = np.empty(big, dtype=np.uint8)
        ssd.read_into(1, b"n" * 32, out).result(10)
        assert np.array_equal(out, payload(8))
        for i in range(8):   # slots 1..8 of 9
            ssd.put(1, bytes([10 + i]) * 32, b"", 0, payload(10 + i)).result(10)
        for i in range(4, 8):
            ssd.delete(1, bytes([10 + i]) * 32).result(10)
    finally:
        ssd.close()
    (tmp_path / f"payload-{small}.dat").write_bytes(b"x" * (16 * small))   # left by a size gone since
    again = SSDTier(str(tmp_path), 64 << 20)
    try:
        assert (tmp_path / f"payload-{big}.dat").stat().st_size == 5 * big   # slots 0..4 still used
        assert not (tmp_path / f"payload-{small}.dat").exists()
        for key, seed in [(b"n" * 32, 8), *((bytes([10 + i]) * 32, 10 + i) for i in range(4))]:
            again.read_into(1, key, out).result(10)
            assert np.array_equal(out, payload(seed))
    finally:
        again.close()


def _disk_bytes(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_free_slots_past_the_disk_budget_give_their_space_back(tmp_path: Path) -> None:
    """Slot files gave disk space back only at their end (or when a size emptied), so while one
    block size replaced another (a model change) both files stayed at their largest: up to twice
    ssd.capacity on disk. Past the disk budget, free slots are now punched out, as they are freed
    and at open (for those a run without a budget left); within it they keep their space (churn
    rewrites them in place). The blocks left read back unchanged; punched slots are written again
    like any other."""
    if not can_punch_holes(tmp_path):
        pytest.skip("this filesystem cannot punch holes")
    size, n = 64 << 10, 64
    keys = [bytes([i]) * 32 for i in range(n)]
    data = tmp_path / f"payload-{size}.dat"
    out = np.empty(size, dtype=np.uint8)

    def check(tier: SSDTier, live: range) -> None:
        for i in live:
            tier.read_into(1, keys[i], out).result(10)
            assert np.array_equal(out, payload(i)), f"block {i} changed"

    def disk_bytes() -> int:
        return data.stat().st_blocks * 512

    ssd = SSDTier(str(tmp_path), 64 << 20, disk_budget=24 * size)
    try:
        for i in range(n):
            ssd.put(1, keys[i], b"", 0, payload(i)).result(10)
        assert disk_bytes() >= n * size   # over the budget, but every slot is in use
        for i in range(n - 8):   # the oldest go first: the file's highest slots stay in use
            ssd.delete(1, keys[i]).result(10)
        assert data.stat().st_size == n * size       # the slots are where they were ...
        # ... but only the budget's hold disk: 8 in use, 16 free ones kept for churn to rewrite
        assert 24 * size <= disk_bytes() <= 25 * size
        check(ssd, range(n - 8, n))
        for i in range(24):   # the 16 free slots that kept their space, then punched ones, are written again
            ssd.put(1, keys[i], b"", 0, payload(i)).result(10)
        check(ssd, range(24))
        assert data.stat().st_size == n * size
    finally:
        ssd.close()

    unbounded = SSDTier(str(tmp_path), 64 << 20)   # no budget: free slots keep their space
    try:
        for i in range(24, n - 8):
            unbounded.put(1, keys[i], b"", 0, payload(i)).result(10)
        for i in range(24, n - 8):
            unbounded.delete(1, keys[i]).result(10)
        assert disk_bytes() >= (n - 8) * size
    finally:
        unbounded.close()
    again = SSDTier(str(tmp_path), 64 << 20, disk_budget=24 * size)   # at open: back within the budget
    try:
        assert disk_bytes() <= 33 * size   # 32 slots in use
        check(again, range(24))
        check(again, range(n - 8, n))
    finally:
        again.close()


def test_writes_are_durable_across_reopen(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20)
    ssd.put_namespace(5, b'{"model": "m"}').result(10)
    ssd.put(5, b"a" * 32, b"", 0, payload(9)).result(10)
    ssd.close()
    again = SSDTier(str(tmp_path), 64 << 20)
    try:
        assert again.namespaces() == {5: b'{"model": "m"}'}
        out = np.empty(64 << 10, dtype=np.uint8)
        again.read_into(5, b"a" * 32, out).result(10)
        assert np.array_equal(out, payload(9))
    finally:
        again.close()


def test_what_the_policies_learned_is_kept_across_reopen_and_is_no_block(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20)
    assert ssd.learned() == {}
    ssd.put_learned("ssd", b'{"scale": 1.0}')
    ssd.put_learned("dram/4096", b'{"scale": 0.5}')
    ssd.put_learned("ssd", b'{"scale": 0.25}').result(10)   # the latest replaces the one before
    ssd.close()
    again = SSDTier(str(tmp_path), 64 << 20)
    try:
        assert again.learned() == {"ssd": b'{"scale": 0.25}', "dram/4096": b'{"scale": 0.5}'}
        assert list(again.scan()) == [] and again.namespaces() == {}
    finally:
        again.close()


def test_no_writemap(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 8 << 20)
    try:
        assert ssd._env.flags()["writemap"] is False
        assert isinstance(ssd._env, lmdb.Environment)
    finally:
        ssd.close()


def test_one_tier_per_directory_and_a_failed_open_leaves_it_free(tmp_path: Path) -> None:
    """Two daemons on one directory overwrote each other's slots: the directory is locked while a
    tier has it open. Regression (code review): an open that failed after taking the lock kept it
    (the next open in the same process found the directory 'in use')."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    ssd.put(1, b"k" * 32, b"", 0, payload(1)).result(10)
    with pytest.raises(InUse, match="in use by this process"):
        SSDTier(str(tmp_path), 64 << 20)
    ssd.close()
    data = tmp_path / f"payload-{64 << 10}.dat"
    data.rename(tmp_path / "aside")
    data.mkdir()                        # opening the payload file fails after the lock is taken
    with pytest.raises(OSError):
        SSDTier(str(tmp_path), 64 << 20)
    data.rmdir()
    (tmp_path / "aside").rename(data)
    again = SSDTier(str(tmp_path), 64 << 20)   # not "in use": the failed open let go of everything
    try:
        out = np.empty(64 << 10, dtype=np.uint8)
        again.read_into(1, b"k" * 32, out).result(10)
        assert np.array_equal(out, payload(1))
    finally:
        again.close()


def test_a_payload_file_that_cannot_be_opened_fails_the_put_not_the_writer(tmp_path: Path) -> None:
    """The first block of a new size opens its payload file on the writer thread, outside the
    try that turns OSError into SSDError: an open that fails (EMFILE, EACCES, ENOSPC, EISDIR)
    killed the writer thread with that batch's futures never settled (the store's write-back
    awaited them for ever, its blocks pinned) and every later put queued with no writer."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        (tmp_path / "payload-4096.dat").mkdir()      # this size's file cannot be opened
        with pytest.raises(SSDError):
            ssd.put(1, b"a" * 32, b"", 0, payload(1, 4096)).result(5)
        ssd.put(1, b"b" * 32, b"", 0, payload(2)).result(5)   # other sizes still get written
    finally:
        (tmp_path / "payload-4096.dat").rmdir()
        ssd.close()


def test_an_unforeseen_error_fails_its_batch_and_the_writer_goes_on(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception out of a commit (not only the disk and LMDB errors it expects) stopped the
    writer thread: nothing reached SSD again until a restart. And once it went on, the slots that
    batch had taken were never given back (the payload file grew while the store counted the
    space as free)."""
    import kvstored.tiers.ssd as ssd_mod

    real, calls = ssd_mod.encode_meta, []

    def failing_once(rec):  # type: ignore[no-untyped-def]
        calls.append(rec)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(rec)

    monkeypatch.setattr(ssd_mod, "encode_meta", failing_once)
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        with pytest.raises(SSDError, match="a bug"):
            ssd.put(1, b"a" * 32, b"", 0, payload(1)).result(5)
        ssd.put(1, b"b" * 32, b"", 0, payload(2)).result(5)
        out = np.empty(64 << 10, np.uint8)
        ssd.read_into(1, b"b" * 32, out).result(5)
        assert np.array_equal(out, payload(2))
        assert ssd.write_errors == 1
        f = ssd._files[64 << 10]
        assert f.top - f.free_slots == 1, f"slots in use {f.top - f.free_slots}: the failed batch's slot leaked"
    finally:
        ssd.close()


class HeldWriter:
    """Holds the writer thread inside the checksum of one put until ``release``, so that what is
    queued meanwhile is committed as one batch."""

    def __init__(self, ssd: SSDTier, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        import kvstored.tiers.ssd as ssd_mod

        self.entered, self.gate, real = threading.Event(), threading.Event(), ssd_mod.checksum

        def held(data):  # type: ignore[no-untyped-def]
            if not self.entered.is_set():
                self.entered.set()
                self.gate.wait(10)
            return real(data)

        monkeypatch.setattr(ssd_mod, "checksum", held)
        self.first = ssd.put(1, b"h" * 32, b"", 0, payload(0, 4096))
        assert self.entered.wait(10)

    def release(self) -> None:
        self.gate.set()


def outcome(fut) -> str:  # type: ignore[no-untyped-def]
    try:
        fut.result(10)
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def test_a_full_map_fails_the_puts_of_a_batch_not_its_deletes(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Deletes queued with puts share their transaction: when the puts filled the LMDB map, the
    deletes (the store's evictions, which were to make room) failed with them. Nobody awaits a
    delete: the store counted the space as free while the records stayed, their slots taken, and
    the map stayed full."""
    ssd = SSDTier(str(tmp_path), 0)
    ssd._env.set_mapsize(64 << 10)
    try:
        stored = []
        for i in range(2000):
            key = bytes([i % 256, i // 256]) * 16
            if outcome(ssd.put(1, key, b"p" * 32, 0, payload(i, 4096))) != "ok":
                break
            stored.append(key)
        assert 20 < len(stored) < 2000
        held = HeldWriter(ssd, monkeypatch)
        deletes = [ssd.delete(1, key) for key in stored[:20]]
        puts = [ssd.put(1, bytes([9, i]) * 16, b"q" * 32, 0, payload(i, 4096)) for i in range(50)]
        held.release()
        outcome(held.first)
        assert [outcome(f) for f in deletes] == ["ok"] * 20
        assert "MapFull" in [outcome(f) for f in puts]
        left = {r.key for r in ssd.scan() if isinstance(r, BlockRecord)}
        assert not left & set(stored[:20]), "deleted records are still in the index"
    finally:
        ssd.close()


def test_a_failed_sync_fails_the_puts_of_a_batch_not_its_deletes(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An fdatasync that fails (EIO) failed the whole batch: its deletes too."""
    from kvstored.tiers import slot_files

    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        ssd.put(1, b"k" * 32, b"", 0, payload(1)).result(10)
        held = HeldWriter(ssd, monkeypatch)

        def eio(self):  # type: ignore[no-untyped-def]
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(slot_files.SlotFile, "sync", eio)
        gone = ssd.delete(1, b"k" * 32)
        new = ssd.put(1, b"n" * 32, b"", 0, payload(2))
        held.release()
        assert outcome(held.first) == "SSDError" and outcome(new) == "SSDError"
        assert outcome(gone) == "ok"
        assert [r for r in ssd.scan()] == []
        f = ssd._files[64 << 10]
        assert f.top - f.free_slots == 0, "slots leaked"
    finally:
        ssd.close()


def _fail_the_next_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier's next commit fails as on a full disk; the ones after go through."""
    real, calls = SSDTier._apply, []

    def full_once(self, batch, written):  # type: ignore[no-untyped-def]
        calls.append(len(batch))
        if len(calls) == 1:
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")
        return real(self, batch, written)

    monkeypatch.setattr(SSDTier, "_apply", full_once)


def test_a_delete_whose_commit_failed_is_made_by_a_later_one(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full disk LMDB's commits fail (ENOSPC, then EIO: it needs new pages, for deletes too),
    and a failed delete was simply lost: nobody awaits one (the store's evictions), so the store
    counted the space as free while the record stayed on disk, its slot taken for good (the file
    growing past ssd.capacity once writes resumed), and the next restart brought the evicted or
    corrupt block back. A delete whose commit failed is made by the next commit that goes through."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        for i in range(4):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
        _fail_the_next_commit(monkeypatch)
        with pytest.raises(SSDError):
            ssd.delete(1, bytes([0]) * 32).result(10)   # the disk is full now
        ssd.put(1, b"n" * 32, b"", 0, payload(9)).result(10)   # space is back: the next commit
        keys = {r.key for r in ssd.scan() if isinstance(r, BlockRecord)}
        assert bytes([0]) * 32 not in keys, "the delete was lost: its record is still on disk"
        f = ssd._files[64 << 10]
        assert f.top - f.free_slots == 4, f"slots in use {f.top - f.free_slots}: the deleted block's slot leaked"
    finally:
        ssd.close()
    again = SSDTier(str(tmp_path), 64 << 20)
    try:
        assert {r.key for r in again.scan() if isinstance(r, BlockRecord)} == \
            {bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32, b"n" * 32}
    finally:
        again.close()


def test_a_lost_delete_does_not_remove_the_record_of_a_later_put_of_the_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delete made again later must not take away the record of the block written again since
    (the store wrote it back once more, in the commit that made the delete)."""
    real, full = SSDTier._apply, [True]

    def while_full(self, batch, written):  # type: ignore[no-untyped-def]
        if full[0]:
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")
        return real(self, batch, written)

    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        ssd.put(1, b"k" * 32, b"", 0, payload(1)).result(10)
        monkeypatch.setattr(SSDTier, "_apply", while_full)
        with pytest.raises(SSDError):
            ssd.delete(1, b"k" * 32).result(10)
        with pytest.raises(SSDError):
            ssd.put(1, b"x" * 32, b"", 0, payload(3)).result(10)   # still full
        full[0] = False
        ssd.put(1, b"k" * 32, b"", 0, payload(2)).result(10)        # written again, space back
        ssd.put(1, b"y" * 32, b"", 0, payload(4)).result(10)
        out = np.empty(64 << 10, dtype=np.uint8)
        ssd.read_into(1, b"k" * 32, out).result(10)
        assert np.array_equal(out, payload(2))
        assert {r.key for r in ssd.scan() if isinstance(r, BlockRecord)} == {b"k" * 32, b"y" * 32}
        f = ssd._files[64 << 10]
        assert f.top - f.free_slots == 2
    finally:
        ssd.close()


def test_a_delete_whose_commit_failed_is_made_at_close_when_no_commit_follows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lost delete was made only by the next commit; at a close with none left to come (the
    space back, nothing more written) it was lost after all, and the next start restored the
    block the store had evicted or found corrupt."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        for i in range(2):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
        _fail_the_next_commit(monkeypatch)
        with pytest.raises(SSDError):
            ssd.delete(1, bytes([0]) * 32).result(10)   # the disk is full now, then space is back
    finally:
        ssd.close()   # no commit after the failed one
    monkeypatch.undo()   # the real commits again
    again = SSDTier(str(tmp_path), 64 << 20)
    try:
        assert {r.key for r in again.scan() if isinstance(r, BlockRecord)} == {bytes([1]) * 32}, \
            "the delete whose commit failed was lost at close: its block comes back"
    finally:
        again.close()


def test_ops_of_one_batch_apply_in_the_order_they_were_queued(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch applied every delete before every put: a put then a delete of one key, committed
    together, left the record on disk although the delete had succeeded."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        held = HeldWriter(ssd, monkeypatch)
        put = ssd.put(1, b"k" * 32, b"", 0, payload(1))
        gone = ssd.delete(1, b"k" * 32)
        held.release()
        assert [outcome(f) for f in (held.first, put, gone)] == ["ok"] * 3
        assert [r.key for r in ssd.scan() if isinstance(r, BlockRecord)] == [b"h" * 32]
        f = ssd._files[64 << 10]
        assert f.top - f.free_slots == 0, "the deleted block's slot was not given back"
    finally:
        ssd.close()


def test_the_payloads_of_format_1_do_not_stay_in_the_index_file(tmp_path: Path) -> None:
    """Format 1 kept payloads in LMDB (database ``blocks``); format 2 reads only ``meta``, whose
    format-1 records the restore drops, but nothing dropped ``blocks``: the old payloads (up to
    the tier's capacity) stayed in the index file for good, beside the new payload files."""
    import struct

    v1_meta = struct.Struct(">HQIQQB")
    env = lmdb.open(str(tmp_path), map_size=64 << 20, max_dbs=4, subdir=True)
    blocks, meta, namespaces = (env.open_db(name) for name in (b"blocks", b"meta", b"namespaces"))
    with env.begin(write=True) as txn:
        txn.put((5).to_bytes(8, "big"), b'{"model": "m"}', db=namespaces)
        for i in range(16):
            key = (5).to_bytes(8, "big") + bytes([i]) * 32
            data = payload(i, 1 << 20)
            txn.put(key, data.tobytes(), db=blocks)
            txn.put(key, v1_meta.pack(1, 5, 0, data.nbytes, 0, 0), db=meta)
    env.close()
    assert (tmp_path / "data.mdb").stat().st_size >= 16 << 20

    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        assert ssd.namespaces() == {5: b'{"model": "m"}'}
        assert sum(1 for r in ssd.scan() if not isinstance(r, BlockRecord)) == 16  # for the restore to drop
        ssd.put(5, b"n" * 32, b"", 0, payload(99)).result(10)
        with ssd._env.begin() as txn:
            assert txn.get(b"blocks") is None
        assert (tmp_path / "data.mdb").stat().st_size < 1 << 20
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data.mdb", "kvstored.lock", "lock.mdb",
                                                              f"payload-{64 << 10}.dat"]
    finally:
        ssd.close()
    again = SSDTier(str(tmp_path), 64 << 20)   # and the compacted index opens as any other
    try:
        out = np.empty(64 << 10, np.uint8)
        again.read_into(5, b"n" * 32, out).result(10)
        assert np.array_equal(out, payload(99))
    finally:
        again.close()


def test_a_put_cancelled_before_the_writer_took_it_is_not_written(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``payload`` must stay unchanged until the put's future is done, and a cancelled future is
    done: its caller may reuse the buffer at once (an arena slot goes to another block). The writer
    still wrote the put, from whatever the buffer held by then, and committed it with a checksum of
    those bytes: another block's bytes stored, and served, under this key."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        held = HeldWriter(ssd, monkeypatch)
        buf = payload(1)
        put = ssd.put(1, b"k" * 32, b"", 0, buf)
        assert put.cancel()
        buf[:] = payload(2)            # the slot now holds another block
        held.release()
        assert outcome(held.first) == "ok"
        ssd.delete(1, b"x" * 32).result(10)   # everything queued before it is done
        assert [r.key for r in ssd.scan() if isinstance(r, BlockRecord)] == [b"h" * 32]
        with pytest.raises(Corrupt, match="missing"):
            ssd.read_into(1, b"k" * 32, np.empty(64 << 10, np.uint8)).result(10)
    finally:
        ssd.close()


def test_a_put_gives_the_checksum_it_stored_and_a_read_gives_it_back(tmp_path: Path) -> None:
    """Both ends of the tier report the block's xxh3 so that the store can keep it (a peer is
    then sent the block without hashing it again)."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        data = [payload(i) for i in range(40)]   # several batches' worth, hashed beside the writes
        futures = [ssd.put(1, bytes([i]) * 32, b"", 0, data[i]) for i in range(40)]
        checks = [f.result(30) for f in futures]
        assert checks == [xxhash.xxh3_64_intdigest(d) for d in data]
        out = np.empty(64 << 10, dtype=np.uint8)
        for i in (0, 17, 39):
            assert ssd.read_into(1, bytes([i]) * 32, out).result(10) == checks[i]
            assert np.array_equal(out, data[i])
    finally:
        ssd.close()


def test_a_known_checksum_is_stored_as_given(tmp_path: Path) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        right = xxhash.xxh3_64_intdigest(payload(1))
        assert ssd.put(1, b"a" * 32, b"", 0, payload(1), right).result(10) == right
        assert ssd.put(1, b"b" * 32, b"", 0, payload(2), right).result(10) == right   # not recomputed
        out = np.empty(64 << 10, dtype=np.uint8)
        assert ssd.read_into(1, b"a" * 32, out).result(10) == right
        with pytest.raises(Corrupt, match="checksum"):   # a wrong one is never taken for the bytes'
            ssd.read_into(1, b"b" * 32, out).result(10)
    finally:
        ssd.close()


def test_reads_queued_before_close_are_served_and_a_read_after_close_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() lets the reads already asked for finish (a promotion waits on each); a read asked
    for after it raises at once rather than queueing one no thread will ever serve."""
    ssd = SSDTier(str(tmp_path), 64 << 20, read_threads=2)
    n = 40   # more than two threads' batches: most are still queued when close() starts
    for i in range(n):
        ssd.put(1, i.to_bytes(32, "big"), b"", 0, payload(i)).result(10)
    gate, real = threading.Event(), ssd._read_jobs

    def held(jobs: list) -> None:  # type: ignore[type-arg]
        assert gate.wait(10)
        real(jobs)
    monkeypatch.setattr(ssd, "_read_jobs", held)
    outs = [np.zeros(64 << 10, dtype=np.uint8) for _ in range(n)]
    futures = [ssd.read_into(1, i.to_bytes(32, "big"), outs[i]) for i in range(n)]
    closing = threading.Thread(target=ssd.close)
    closing.start()
    late: list[tuple[int, np.ndarray, object]] = []   # asked for while close() starts: served too
    with pytest.raises(RuntimeError, match="closed"):
        for k in range(1000):   # close() refuses new reads before it waits for the queued ones
            out = np.zeros(64 << 10, dtype=np.uint8)
            late.append((k % n, out, ssd.read_into(1, (k % n).to_bytes(32, "big"), out)))
            threading.Event().wait(0.001)
    gate.set()
    closing.join(30)
    assert not closing.is_alive()
    for i, (f, out) in enumerate(zip(futures, outs)):
        assert f.result(0) == xxhash.xxh3_64_intdigest(payload(i))
        assert np.array_equal(out, payload(i))
    for i, out, f in late:
        assert f.result(0) == xxhash.xxh3_64_intdigest(payload(i))  # type: ignore[attr-defined]
        assert np.array_equal(out, payload(i))


def test_a_read_that_breaks_fails_its_future_and_the_read_threads_go_on(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20, read_threads=1)
    try:
        for i in range(3):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
        real_payload, real_env = ssd._read_payload, ssd._env

        def read_payload(rec: BlockRecord, dst: np.ndarray) -> int:
            if rec.key == bytes([1]) * 32:
                raise ValueError("unforeseen")
            return real_payload(rec, dst)
        monkeypatch.setattr(ssd, "_read_payload", read_payload)
        out = np.zeros(64 << 10, dtype=np.uint8)
        with pytest.raises(ValueError, match="unforeseen"):
            ssd.read_into(1, bytes([1]) * 32, out).result(10)

        class BrokenIndex:
            def begin(self) -> None:
                raise lmdb.Error("index unreadable")
        monkeypatch.setattr(ssd, "_env", BrokenIndex())
        with pytest.raises(lmdb.Error, match="unreadable"):
            ssd.read_into(1, bytes([0]) * 32, out).result(10)
        monkeypatch.setattr(ssd, "_env", real_env)
        for i in (0, 2):   # the one read thread is still there
            ssd.read_into(1, bytes([i]) * 32, out).result(10)
            assert np.array_equal(out, payload(i))
    finally:
        ssd.close()


def test_reads_of_consecutive_slots_queued_together_are_merged_and_each_is_verified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small blocks queued together come up in one preadv per run of consecutive slots (up to
    MERGE_BYTES); every block is still checked on its own: a corrupt one in a merged read fails
    alone, and one whose merged read came up short is read again by itself."""
    ssd = SSDTier(str(tmp_path), 64 << 20, read_threads=1)
    try:
        n = 12
        for i in range(n):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
        f = ssd._file(64 << 10)
        with open(tmp_path / f"payload-{64 << 10}.dat", "r+b") as fh:   # block 5's slot, behind the tier's back
            fh.seek(5 * f.stride + 100)
            byte = fh.read(1)
            fh.seek(5 * f.stride + 100)
            fh.write(bytes([byte[0] ^ 0xFF]))
        calls: list[int] = []
        real_run, real_jobs = f.read_run, ssd._read_jobs

        def read_run(slot: int, dsts: list[np.ndarray]) -> int:
            calls.append(len(dsts))
            got = real_run(slot, dsts)
            if len(dsts) > 1 and max(calls[:-1], default=1) == 1:   # the first merged read comes up short
                dsts[-1][-1:] = 0
                return got - 1
            return got
        gate = threading.Event()

        def read_jobs(jobs: list) -> None:  # type: ignore[type-arg]
            assert gate.wait(10)   # the first read holds the thread until all are queued
            real_jobs(jobs)
        monkeypatch.setattr(f, "read_run", read_run)
        monkeypatch.setattr(ssd, "_read_jobs", read_jobs)
        outs = [np.zeros(64 << 10, dtype=np.uint8) for _ in range(n)]
        futures = [ssd.read_into(1, bytes([i]) * 32, outs[i]) for i in range(n)]
        gate.set()
        for i, fut in enumerate(futures):
            if i == 5:
                with pytest.raises(Corrupt, match="checksum"):
                    fut.result(10)
            else:
                assert fut.result(10) == xxhash.xxh3_64_intdigest(payload(i))
                assert np.array_equal(outs[i], payload(i))
        assert max(calls) > 1, f"no read was merged: {calls}"
        assert len(calls) <= 3 and calls[-1] == 1, f"reads for {n} blocks queued together: {calls}"
        assert ssd.checksum_failures == 1
    finally:
        ssd.close()


@pytest.mark.parametrize("layout", ["a gap in the slots", "blocks of 5,000 bytes"])
def test_reads_that_cannot_be_merged_are_read_one_by_one_with_the_right_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """Only whole-page slots that follow one another are merged: one preadv over a gap, or over
    slots whose stride is longer than the payload, would shift every later block's bytes."""
    size = 5000 if layout == "blocks of 5,000 bytes" else 64 << 10
    ssd = SSDTier(str(tmp_path), 64 << 20, read_threads=1)
    try:
        for i in range(8):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i, size)).result(10)
        wanted = [0, 1, 2, 4, 5, 6] if layout == "a gap in the slots" else list(range(8))
        gate, real = threading.Event(), ssd._read_jobs

        def held(jobs: list) -> None:  # type: ignore[type-arg]
            assert gate.wait(10)   # the first read holds the thread until all are queued
            real(jobs)
        monkeypatch.setattr(ssd, "_read_jobs", held)
        outs = {i: np.zeros(size, dtype=np.uint8) for i in wanted}
        futures = {i: ssd.read_into(1, bytes([i]) * 32, outs[i]) for i in wanted}
        gate.set()
        for i in wanted:
            assert futures[i].result(10) == xxhash.xxh3_64_intdigest(payload(i, size))
            assert np.array_equal(outs[i], payload(i, size)), f"block {i} came up with other bytes"
        assert ssd.checksum_failures == 0
    finally:
        ssd.close()


def test_reads_of_scattered_slots_still_run_on_every_read_thread(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread takes at most its share of the queued reads: taking all of them, it read 16
    scattered blocks one after another while the other threads found the queue empty."""
    ssd = SSDTier(str(tmp_path), 64 << 20, read_threads=4)
    try:
        for i in range(32):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
        lock, in_flight, most = threading.Lock(), [0], [0]
        f = ssd._file(64 << 10)
        real = f.read_run

        def slow(slot: int, dsts: list[np.ndarray]) -> int:
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            try:
                threading.Event().wait(0.02)   # a slow disk: each read takes 20 ms
                return real(slot, dsts)
            finally:
                with lock:
                    in_flight[0] -= 1
        monkeypatch.setattr(f, "read_run", slow)
        order = list(range(0, 32, 2))
        random.Random(1).shuffle(order)
        outs = [np.zeros(64 << 10, dtype=np.uint8) for _ in order]
        futures = [ssd.read_into(1, bytes([i]) * 32, out) for i, out in zip(order, outs)]
        for i, fut, out in zip(order, futures, outs):
            fut.result(30)
            assert np.array_equal(out, payload(i))
        assert most[0] >= 2, f"at most {most[0]} read(s) at a time on 4 read threads"
    finally:
        ssd.close()


def test_a_merged_read_that_breaks_in_an_unforeseen_way_falls_back_to_reads_one_by_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssd = SSDTier(str(tmp_path), 64 << 20, read_threads=1)
    try:
        for i in range(6):
            ssd.put(1, bytes([i]) * 32, b"", 0, payload(i)).result(10)
        f = ssd._file(64 << 10)
        real_run, real_jobs, gate = f.read_run, ssd._read_jobs, threading.Event()

        def read_run(slot: int, dsts: list[np.ndarray]) -> int:
            if len(dsts) > 1:
                raise ValueError("a buffer the kernel cannot take")
            return real_run(slot, dsts)

        def held(jobs: list) -> None:  # type: ignore[type-arg]
            assert gate.wait(10)
            real_jobs(jobs)
        monkeypatch.setattr(f, "read_run", read_run)
        monkeypatch.setattr(ssd, "_read_jobs", held)
        outs = [np.zeros(64 << 10, dtype=np.uint8) for _ in range(6)]
        futures = [ssd.read_into(1, bytes([i]) * 32, outs[i]) for i in range(6)]
        gate.set()
        for i, fut in enumerate(futures):
            assert fut.result(10) == xxhash.xxh3_64_intdigest(payload(i))
            assert np.array_equal(outs[i], payload(i))
    finally:
        ssd.close()


def test_a_barrier_behind_a_delete_whose_commit_failed_carries_the_error(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """(review) barrier() promises SSDError while a delete queued before it is not committed. A
    delete whose commit failed in an earlier batch (the writer took it before the barrier was
    queued: Evict queues its deletes one by one while the writer runs) stays in _lost_deletes;
    when the retry at the barrier's commit failed too, the barrier's own (empty) transaction
    committed and the barrier reported success: kvctl evict said nothing, and a kill -9 then
    brought the evicted blocks back."""
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        ssd.put(1, b"k" * 32, b"", 0, payload(1)).result(10)
        real = ssd._apply

        def deletes_fail(batch, written):  # type: ignore[no-untyped-def]
            if any(op.kind == "delete" for op in batch):
                raise lmdb.MapFullError("map full")   # a delete needs fresh pages; an empty commit does not
            return real(batch, written)

        monkeypatch.setattr(ssd, "_apply", deletes_fail)
        with pytest.raises(SSDError):
            ssd.delete(1, b"k" * 32).result(10)
        with pytest.raises(SSDError, match="not committed"):
            ssd.barrier().result(10)
        monkeypatch.setattr(ssd, "_apply", real)
        ssd.barrier().result(10)   # the retry committed the delete now
        assert not [r for r in ssd.scan() if isinstance(r, BlockRecord)]
    finally:
        ssd.close()


def test_a_blocks_reuse_count_is_kept_with_its_record_and_updated(tmp_path: Path) -> None:
    """The policies' history survives a restart: a block is written with its reuse count, the
    count can be raised later (at shutdown), and it is read back with the record after a reopen;
    a record of the format before counts (version 2) reads as never reused."""
    import struct

    from kvstored.tiers import ssd as ssd_mod

    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        ssd.put(7, b"a" * 32, b"", 0, payload(1), reuses=3).result(10)
        ssd.put(7, b"b" * 32, b"a" * 32, 1, payload(2)).result(10)
        ssd.set_reuses(7, b"b" * 32, 5)
        ssd.set_reuses(7, b"gone" * 8, 9)   # no such record: nothing happens
        ssd.barrier().result(10)
    finally:
        ssd.close()
    ssd = SSDTier(str(tmp_path), 64 << 20)
    try:
        records = {r.key: r for r in ssd.scan() if isinstance(r, BlockRecord)}
        assert {k: r.reuses for k, r in records.items()} == {b"a" * 32: 3, b"b" * 32: 5}
        out = np.empty(64 << 10, dtype=np.uint8)
        assert ssd.read_into(7, b"b" * 32, out).result(10) and np.array_equal(out, payload(2))
    finally:
        ssd.close()
    rec = BlockRecord(7, b"c" * 32, b"", 0, 4096, 1234, 5)
    v2 = struct.pack(">HQIQQQB", 2, 7, 0, 4096, 1234, 5, 0)
    assert ssd_mod.decode_meta(v2, ssd_mod.db_key(7, b"c" * 32)) == rec
    assert ssd_mod.decode_meta(ssd_mod.encode_meta(rec), ssd_mod.db_key(7, b"c" * 32)) == rec
    with pytest.raises(Corrupt):   # a version 3 record cut short of its count
        ssd_mod.decode_meta(ssd_mod.encode_meta(rec)[:-2], ssd_mod.db_key(7, b"c" * 32))
