"""The SSD tier: block payloads in slot files written with O_DIRECT, their index in LMDB.

Payloads live in one file per payload size (``payload-<bytes>.dat``), in fixed slots, written
straight from the DRAM arena with ``O_DIRECT``: buffered writes through the page cache (which is
how LMDB writes its values) ran at about a third of the disk's direct write speed here. LMDB holds
the index: per block a small ``meta`` record (format version, namespace, parent hash, depth,
length, checksum, slot) and the namespaces, so a restart rebuilds the radix index by scanning
``meta`` only.

Crash safety comes from ordering, done by the one writer thread: a batch's payloads are written and
``fdatasync``-ed before the LMDB transaction that makes them visible commits (group commit: one
sync for everything queued), and a slot freed by a delete is reused only after that delete has
committed. A crash therefore leaves every visible record pointing at the bytes it was written
with; slots nobody references are free at the next start (and the disk space past the highest
slot in use, or of a size with no block left, goes back). Free slots keep their disk space for
churn to rewrite in place, as long as the slots that hold disk space stay within the tier's disk
budget (the store's capacity plus the gap between its watermarks); past it (one block size
shrinking while another grows: a model change) free slots are punched out, so the files stay near
the budget. Every read verifies length and checksum
and reports a mismatch, never returns it. A full disk is an error (``SSDError``), never a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import queue
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash

from kvstored.tiers.slot_files import ALIGN, SlotFile

log = logging.getLogger("kvstored.ssd")

FORMAT_VERSION = 3   # 3: the block's reuse count after the parent hash (2 has none: read as 0)
# Reads of consecutive slots queued together are merged into one preadv up to this many bytes:
# for small blocks a read's thread hand-offs and GIL waits cost more than the read (64 KiB blocks
# came up at half the speed); a 2 MiB block is read alone.
MERGE_BYTES = 1 << 20
PROGRESS_EVERY = 4096   # records between progress reports of a long scan
Progress = Callable[[str, int, int], None]   # (what, done, total or 0 when not known)
# version, namespace id, depth, length, checksum, slot, parent length, then the parent hash, then
# (version 3) the reuse count
_META = struct.Struct(">HQIQQQB")
_REUSES = struct.Struct(">I")


class SSDError(Exception):
    """A write could not be completed (disk full, I/O error); nothing was stored."""


class MapFull(SSDError):
    """LMDB's map (the index) is full: evict and retry."""


class InUse(SSDError):
    """Another process has the tier's directory open: two daemons would overwrite each other's
    slots."""


_LOCK_FILE = "kvstored.lock"
_LEGACY_PAYLOADS = b"blocks"   # format 1's payload database
_COMPACTED = "compacted.tmp"


def _lock_directory(path: Path) -> int:
    """Hold ``path``'s lock file exclusively (until the returned descriptor is closed), with our
    pid in it for the message another daemon gets. InUse when someone else holds it."""
    fd = os.open(path / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        whom = "this process" if holder == str(os.getpid()) else f"another kvstored (pid {holder})"
        raise InUse(f"{path} is in use by {whom}; give each daemon its own ssd.path") from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Corrupt(Exception):
    """A stored payload is missing or failed its length or checksum check."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What ``meta`` says about one stored block."""

    namespace_id: int
    key: bytes            # the block hash (without the namespace prefix)
    parent: bytes         # the parent's block hash, b"" for a root block
    depth: int            # index of the block in its chain (0 = first block)
    length: int
    checksum: int
    slot: int = 0
    reuses: int = 0       # how often the block had been reused when its record was last written


def checksum(data: memoryview | bytes | np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]


def db_key(namespace_id: int, key: bytes) -> bytes:
    return namespace_id.to_bytes(8, "big") + key


def encode_meta(rec: BlockRecord) -> bytes:
    return _META.pack(FORMAT_VERSION, rec.namespace_id, rec.depth, rec.length, rec.checksum, rec.slot,
                      len(rec.parent)) + rec.parent + _REUSES.pack(min(rec.reuses, 0xFFFFFFFF))


def decode_meta(raw: bytes, key: bytes) -> BlockRecord:
    """A ``meta`` record of this format or of version 2 (written before reuse counts: 0 reuses)."""
    try:
        version, ns, depth, length, check, slot, plen = _META.unpack_from(raw)
    except struct.error:
        raise Corrupt("meta record truncated") from None
    if version not in (2, FORMAT_VERSION):
        raise Corrupt(f"unknown format version {version}")
    end = _META.size + plen
    parent = bytes(raw[_META.size:end])
    reuses = 0
    if version >= 3:
        if len(raw) < end + _REUSES.size:
            raise Corrupt("meta record truncated")
        (reuses,) = _REUSES.unpack_from(raw, end)
    if len(parent) != plen or int.from_bytes(key[:8], "big") != ns:
        raise Corrupt("meta record does not match its key")
    return BlockRecord(ns, bytes(key[8:]), parent, depth, length, check, slot, reuses)


@dataclass(slots=True)
class _Op:
    kind: str                       # "put" | "delete" | "namespace" | "barrier" | "reuses" | "learned"
    key: bytes
    meta: bytes                     # "namespace": the spec; "put": filled in by the writer; "reuses": the count;
                                    # "learned": a policy's state
    payload: np.ndarray | None      # "put": the block's bytes
    done: Future[Any]               # "put": its checksum; the others: None
    record: BlockRecord | None = None   # "put": its checksum is the caller's (0: not known)
    check: Future[int] | None = None    # "put": the checksum being computed on the hash thread


class SSDTier:
    """The tier's files, its writer thread and read pool. Entry points are thread-safe and
    return futures."""

    def __init__(self, path: str, map_size: int, read_threads: int = 2, sync: bool = True,
                 group_commit_bytes: int = 64 << 20, progress: Progress | None = None,
                 disk_budget: int | None = None) -> None:
        """Open (or create) the tier in ``path``, reading its index for the slots in use;
        ``progress(what, records read, 0)`` is called every PROGRESS_EVERY records.
        ``disk_budget``: payload bytes the slots that hold disk space may add up to (the store's
        capacity) before free slots are punched out; None: free slots keep their space."""
        self.path = Path(path)
        self._disk_budget = disk_budget
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.path)
        # The index needs ~150 bytes a block; the map is sparse address space, so generous is free.
        self.map_size = max(map_size, 1 << 20)
        self._files: dict[int, SlotFile] = {}
        self._files_lock = threading.Lock()
        env = None
        try:
            env = self._env = self._open_env(sync)
            if self._drop_legacy_payloads():   # its compacted copy replaces the index file
                env = None
                self._env.close()
                os.replace(self.path / _COMPACTED / "data.mdb", self.path / "data.mdb")
                shutil.rmtree(self.path / _COMPACTED)
                env = self._env = self._open_env(sync)
            self._meta = self._env.open_db(b"meta")
            self._namespaces = self._env.open_db(b"namespaces")
            self._learned = self._env.open_db(b"learned")   # what the policies learned, by tier
            used: dict[int, set[int]] = {}
            for n, item in enumerate(self.scan(), 1):
                if progress is not None and n % PROGRESS_EVERY == 0:
                    progress("reading the SSD index", n, 0)
                if isinstance(item, BlockRecord):
                    used.setdefault(item.length, set()).add(item.slot)
            for length, slots in used.items():
                self._file(length, slots)   # each cut to its highest slot in use
            self._remove_unused_files(used)
            self._trim_to_budget()   # a run that stopped in the middle of a model change
        except BaseException:   # nothing stays open, the directory's lock included
            for f in self._files.values():
                f.close()
            if env is not None:
                env.close()
            os.close(self._lock_fd)
            raise
        self._sync = sync
        self._group_bytes = group_commit_bytes
        # keys whose delete failed to commit (a full disk): nobody awaits a delete, so the writer
        # makes it again with the next commit (else the record stayed, its slot taken for good,
        # and the next start restored the block the store had evicted or found corrupt)
        self._lost_deletes: dict[bytes, None] = {}
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvstored-ssd-writer", daemon=True)
        self._writer.start()
        # Read threads of our own on a plain queue, not a ThreadPoolExecutor: a prompt's blocks
        # are queued from the event loop one by one, and the executor's submit cost ~30 us a block
        # there on a 2-core VM (twice this queue and its future), time every other client waits.
        self._reads: queue.SimpleQueue[tuple[bytes, np.ndarray, Future[int]] | None] = queue.SimpleQueue()
        self._reads_lock = threading.Lock()   # no read queued after the readers were told to stop
        self._reads_open = True
        self._read_threads = [threading.Thread(target=self._read_loop, name=f"kvstored-ssd-read-{i}", daemon=True)
                              for i in range(read_threads)]
        for thread in self._read_threads:
            thread.start()
        # Payload checksums are computed here while the writer writes (xxh3 releases the GIL):
        # hashed in the writer's turn they cost ~15% of the write time
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstored-ssd-hash")
        self.write_errors = 0
        self.checksum_failures = 0

    def _remove_unused_files(self, used: dict[int, set[int]]) -> None:
        """Remove the payload files of sizes no record has (all their blocks left before the last
        stop): nothing would ever open them again, and their disk space stayed taken for good."""
        for file in self.path.glob("payload-*.dat"):
            length = file.name[len("payload-"):-len(".dat")]
            if length.isdigit() and int(length) not in used:
                try:
                    file.unlink(missing_ok=True)
                except OSError as exc:   # the tier works all the same
                    log.warning("could not remove %s, which no block uses: %s", file, exc)

    def _open_env(self, sync: bool) -> lmdb.Environment:
        return lmdb.open(str(self.path), map_size=self.map_size, max_dbs=8, writemap=False, readahead=True,
                         sync=sync, metasync=sync, max_readers=126, lock=True, subdir=True)

    def _drop_legacy_payloads(self) -> bool:
        """Format 1 kept every payload in an LMDB database of its own (``blocks``), which this
        format never reads: drop it and write a compacted copy of the index, else the old payloads
        (up to the tier's capacity) stayed in the index file for good beside the payload files.
        True when the copy is in ``_COMPACTED``, to replace the index file once it is closed."""
        with self._env.begin() as txn:
            if txn.get(_LEGACY_PAYLOADS) is None:
                return False
        log.warning("dropping the block payloads of an older format (LMDB database %r) in %s",
                    _LEGACY_PAYLOADS.decode(), self.path)
        blocks = self._env.open_db(_LEGACY_PAYLOADS, create=False)
        with self._env.begin(write=True) as txn:
            txn.drop(blocks, delete=True)
        compacted = self.path / _COMPACTED
        shutil.rmtree(compacted, ignore_errors=True)
        try:
            compacted.mkdir()
            self._env.copy(str(compacted), compact=True)
            fd = os.open(compacted / "data.mdb", os.O_RDONLY)
            try:
                os.fsync(fd)   # on disk before it replaces the index
            finally:
                os.close(fd)
        except (OSError, lmdb.Error) as exc:   # e.g. no room for the copy: the pages are free inside
            log.warning("could not compact the index in %s: %s", self.path, exc)
            shutil.rmtree(compacted, ignore_errors=True)
            return False
        return True

    def _file(self, length: int, used: set[int] | None = None) -> SlotFile:
        with self._files_lock:
            f = self._files.get(length)
            if f is None:
                f = self._files[length] = SlotFile(self.path / f"payload-{length}.dat", length, used or set())
            return f

    # -- writes (one thread owns every write) ------------------------------------------------
    def put(self, namespace_id: int, key: bytes, parent: bytes, depth: int, payload: np.ndarray,
            known_checksum: int | None = None, reuses: int = 0) -> Future[int]:
        """Queue a block write; the future gives the payload's xxh3-64 checksum (as stored) once
        the block is on disk, or fails with SSDError. ``known_checksum``: the payload's checksum
        when the caller has it, stored as given (a wrong one makes every read of the block fail
        its check); otherwise it is computed while the batch is written. ``payload`` must stay
        valid and unchanged until the future is done; a put cancelled before the writer takes it
        is not written (once taken, it can no longer be cancelled). ``reuses``: how often the block
        has been reused, kept with its record for the policies after a restart."""
        fut: Future[int] = Future()
        check: Future[int] | None = None
        if known_checksum is not None:
            check = Future()
            check.set_result(known_checksum)
        rec = BlockRecord(namespace_id, key, parent, depth, int(payload.nbytes), 0, reuses=reuses)
        self._ops.put(_Op("put", db_key(namespace_id, key), b"", payload, fut, rec, check))
        return fut

    def delete(self, namespace_id: int, key: bytes) -> Future[None]:
        return self.delete_raw(db_key(namespace_id, key))

    def delete_raw(self, key: bytes) -> Future[None]:
        """Delete by database key (namespace id ‖ hash), also for records that do not decode."""
        fut: Future[None] = Future()
        self._ops.put(_Op("delete", key, b"", None, fut))
        return fut

    def set_reuses(self, namespace_id: int, key: bytes, reuses: int) -> Future[None]:
        """Queue a new reuse count for a stored block's record (nothing when it has none)."""
        fut: Future[None] = Future()
        self._ops.put(_Op("reuses", db_key(namespace_id, key), _REUSES.pack(min(reuses, 0xFFFFFFFF)), None, fut))
        return fut

    def put_namespace(self, namespace_id: int, spec_json: bytes) -> Future[None]:
        fut: Future[None] = Future()
        self._ops.put(_Op("namespace", namespace_id.to_bytes(8, "big"), spec_json, None, fut))
        return fut

    def put_learned(self, name: str, state: bytes) -> Future[None]:
        """Queue what the policy ``name`` (a tier's) has learned, replacing what it had recorded."""
        fut: Future[None] = Future()
        self._ops.put(_Op("learned", name.encode(), state, None, fut))
        return fut

    def learned(self) -> dict[str, bytes]:
        """What :meth:`put_learned` recorded, by name."""
        with self._env.begin() as txn:
            return {bytes(k).decode(errors="replace"): bytes(v) for k, v in txn.cursor(db=self._learned)}

    def barrier(self) -> Future[None]:
        """Done once every op queued before it has been committed (or has failed: with a
        failed delete it carries SSDError, and the writer makes the delete at its next commit)."""
        fut: Future[None] = Future()
        self._ops.put(_Op("barrier", b"", b"", None, fut))
        return fut

    def _write_loop(self) -> None:
        batch: list[_Op] = []
        try:
            while True:
                batch = []
                op = self._ops.get()
                if op is None:
                    self._last_lost_deletes()
                    return
                # An op is started as it is taken: one cancelled before is dropped (its caller may
                # already reuse the payload), one taken can no longer be cancelled.
                if not op.done.set_running_or_notify_cancel():
                    continue
                batch, size, stop = [op], _size(op), False
                # Group commit: everything already queued (up to a byte budget) shares one sync.
                while size < self._group_bytes:
                    try:
                        nxt = self._ops.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        stop = True
                        break
                    if nxt.done.set_running_or_notify_cancel():
                        batch.append(nxt)
                        size += _size(nxt)
                try:
                    self._commit(batch)
                except Exception as exc:   # a bug or an error nobody foresaw: fail this batch, go on
                    log.exception("SSD commit of %d op(s) failed unexpectedly", len(batch))
                    self.write_errors += len(batch)
                    for failed in batch:
                        _settle(failed.done, SSDError(f"SSD write failed: {exc!r}"))
                if stop:
                    self._last_lost_deletes()
                    return
        except BaseException:  # never die silently: queued callers would wait forever
            log.exception("SSD writer thread failed")
            for op in batch:
                _settle(op.done, SSDError("the SSD writer stopped"))
            while True:
                try:
                    left = self._ops.get_nowait()
                except queue.Empty:
                    return
                if left is not None:
                    _settle(left.done, SSDError("the SSD writer stopped"))

    def _commit(self, batch: list[_Op]) -> None:
        written: dict[int, tuple[SlotFile, int]] = {}   # id(put op) -> where its payload went
        failed: dict[int, Exception] = {}
        if self._lost_deletes:
            self._retry_lost_deletes()
        for op in batch:
            if op.kind == "put" and op.check is None:
                op.check = self._hasher.submit(checksum, op.payload)   # type: ignore[arg-type]
        for op in batch:
            if op.kind != "put":
                continue
            assert op.record is not None and op.payload is not None, "put without a record"
            try:
                f = self._file(op.record.length)
            except OSError as exc:
                failed[id(op)] = SSDError(f"payload file: {exc.strerror or exc}")
                continue
            slot = f.take()
            try:
                f.write(slot, op.payload)
            except OSError as exc:
                f.give_back(slot)
                failed[id(op)] = SSDError(f"payload write failed: {exc.strerror or exc}")
                continue
            written[id(op)] = (f, slot)   # first: an unforeseen error below gives the slot back
            rec = op.record
            try:
                assert op.check is not None, "a put without its checksum"
                op.meta = encode_meta(BlockRecord(rec.namespace_id, rec.key, rec.parent, rec.depth, rec.length,
                                                  op.check.result(), slot, rec.reuses))
            except BaseException:
                self._give_back(written)
                raise
        try:
            if self._sync and written:
                try:
                    for f in {f for f, _ in written.values()}:
                        f.sync()  # payloads are on disk before any record points at them
                except OSError as exc:
                    # The batch's deletes and namespace records do not depend on these payloads:
                    # they still commit (a delete failed with the puts left its record on disk,
                    # its slot taken, while the store counted the space as free).
                    self._fail_puts(written, failed, SSDError(f"payload sync failed: {exc.strerror or exc}"))
            try:
                freed = self._apply(batch, written)
            except (lmdb.Error, OSError) as exc:
                if not written:
                    raise
                # Most likely the puts filled the map: the deletes alone (which make room) go on.
                self._fail_puts(written, failed, _commit_error(exc))
                freed = self._apply(batch, written)
        except BaseException as exc:
            lost = len(written) + len(failed)
            self._give_back(written)     # nothing committed: no record points at them
            if not isinstance(exc, (lmdb.Error, OSError)):
                raise                    # _write_loop fails the batch
            self.write_errors += lost
            error = _commit_error(exc)
            log.warning("SSD commit of %d op(s) failed: %s", len(batch), exc)
            for op in batch:
                if op.kind == "delete":
                    self._lost_deletes[op.key] = None
            for op in batch:
                _settle(op.done, failed.get(id(op), error))
            return
        for f, slot in freed:  # reusable only now that no committed record points at them
            f.give_back(slot)
        self._trim_to_budget()
        if self._lost_deletes:
            for op in batch:   # a delete or a put of the block committed now supersedes a lost delete
                if op.kind == "delete" or id(op) in written:
                    self._lost_deletes.pop(op.key, None)
        self.write_errors += len(failed)
        if failed:
            log.warning("SSD write of %d block(s) failed: %s", len(failed), next(iter(failed.values())))
        # deletes queued before a barrier whose commit failed in an earlier batch (and again in
        # the retry above): the barrier is not the "all committed" it stands for
        behind = SSDError(f"{len(self._lost_deletes)} delete(s) queued before this barrier not committed yet") \
            if self._lost_deletes else None
        for op in batch:
            _settle(op.done, behind if op.kind == "barrier" else failed.get(id(op)),
                    op.check.result() if id(op) in written and op.check else None)

    def _apply(self, batch: list[_Op], written: dict[int, tuple[SlotFile, int]]) -> list[tuple[SlotFile, int]]:
        """Commit the batch's index changes in the order they were queued (a put then a delete of
        one key leaves no record); the slots the committed transaction no longer references."""
        freed: list[tuple[SlotFile, int]] = []
        with self._env.begin(write=True) as txn:
            for op in batch:
                if op.kind == "namespace":
                    txn.put(op.key, op.meta, db=self._namespaces)
                    continue
                if op.kind == "learned":
                    txn.put(op.key, op.meta, db=self._learned)
                    continue
                if op.kind == "reuses":
                    raw = txn.get(op.key, db=self._meta)
                    if raw is not None:   # else deleted meanwhile
                        with contextlib.suppress(Corrupt):   # a read of it reports it
                            rec = decode_meta(bytes(raw), op.key)
                            (reuses,) = _REUSES.unpack(op.meta)
                            txn.put(op.key, encode_meta(dataclasses.replace(rec, reuses=reuses)), db=self._meta)
                    continue
                if op.kind == "delete":
                    old = txn.pop(op.key, db=self._meta)
                elif id(op) in written:
                    old = txn.get(op.key, db=self._meta)   # the same block written again: free the old slot
                    txn.put(op.key, op.meta, db=self._meta)
                else:
                    continue   # a put that failed before the transaction
                if old is not None:
                    try:
                        rec = decode_meta(bytes(old), op.key)
                        freed.append((self._file(rec.length), rec.slot))
                    except Corrupt:
                        pass
        return freed

    def _trim_to_budget(self) -> None:
        """Past the disk budget, free slots give their disk space back (punched out), those of
        the files with most free slots first: while one block size replaces another, the old
        size's free slots no longer hold disk beside the new size's, which held up to about twice
        the capacity. Within it they keep it, so that steady churn rewrites slots in place."""
        if self._disk_budget is None:
            return
        with self._files_lock:
            files = list(self._files.values())
        over = sum(f.allocated_bytes for f in files) - self._disk_budget
        for f in sorted(files, key=lambda f: len(f.free), reverse=True):
            if over <= 0:
                return
            over -= f.punch_free(over)

    def _retry_lost_deletes(self) -> None:
        """Make the deletes whose commit failed, in a transaction of their own (before the batch:
        a put of one of those blocks in it then writes a record of its own, which stays)."""
        keys = list(self._lost_deletes)
        ops = [_Op("delete", key, b"", None, Future()) for key in keys]
        try:
            freed = self._apply(ops, {})
        except (lmdb.Error, OSError) as exc:   # still no room: the next commit tries again
            log.debug("deletes whose commit failed are still not made: %s", exc)
            return
        for f, slot in freed:
            f.give_back(slot)
        for key in keys:
            self._lost_deletes.pop(key, None)
        log.info("made %d delete(s) whose commit had failed", len(keys))

    def _last_lost_deletes(self) -> None:
        """At close no commit follows to make the deletes whose commit failed: one more try, else
        the next start restored the blocks the store had evicted or found corrupt."""
        if self._lost_deletes:
            try:
                self._retry_lost_deletes()
            except Exception:   # an error nobody foresaw: the close goes on
                log.exception("the deletes whose commit failed could not be made at close")
        if self._lost_deletes:
            log.warning("%d delete(s) whose commit failed could not be made before close: their "
                        "blocks come back at the next start", len(self._lost_deletes))

    @staticmethod
    def _give_back(written: dict[int, tuple[SlotFile, int]]) -> None:
        for f, slot in written.values():
            f.give_back(slot)
        written.clear()

    def _fail_puts(self, written: dict[int, tuple[SlotFile, int]], failed: dict[int, Exception],
                   error: Exception) -> None:
        for key in written:
            failed[key] = error
        self._give_back(written)

    # -- reads -------------------------------------------------------------------------------
    def read_into(self, namespace_id: int, key: bytes, dst: np.ndarray) -> Future[int]:
        """Copy a block's payload into ``dst`` (uint8) on a read thread, verifying its length and
        checksum against its meta record; the future gives that checksum, or fails with Corrupt on
        any mismatch. Reads start in the order asked for. The future is running from the start
        (it cannot be cancelled: ``dst`` is written unless the tier fails first); its callbacks
        run on the read thread. Raises RuntimeError once the tier is closed."""
        fut: Future[int] = Future()
        fut.set_running_or_notify_cancel()
        with self._reads_lock:
            if not self._reads_open:
                raise RuntimeError("the SSD tier is closed")
            self._reads.put((db_key(namespace_id, key), dst, fut))
        return fut

    def stop_reads(self) -> None:
        """Serve the reads queued so far, then refuse any more (``read_into`` raises); returns when
        the read threads are gone. The first step of ``close``."""
        with self._reads_lock:
            if self._reads_open:
                self._reads_open = False
                for _ in self._read_threads:
                    self._reads.put(None)
        for thread in self._read_threads:
            thread.join()

    def _read_loop(self) -> None:
        stopping = False
        while not stopping:
            job = self._reads.get()
            if job is None:
                return
            jobs, size = [job], job[1].nbytes
            # The reads queued behind it, for merged reads; at most this thread's share, so that
            # reads of scattered slots (read one by one) still keep every read thread busy.
            share = self._reads.qsize() // len(self._read_threads)
            while size < MERGE_BYTES and len(jobs) <= share:
                try:
                    more = self._reads.get_nowait()
                except queue.Empty:
                    break
                if more is None:   # this thread's stop: after these
                    stopping = True
                    break
                jobs.append(more)
                size += more[1].nbytes
            try:
                self._read_jobs(jobs)
            except Exception as exc:   # the index itself failed (LMDB): these reads fail, the thread goes on
                for _, _, fut in jobs:
                    if not fut.done():
                        fut.set_exception(exc)

    def _read_jobs(self, jobs: list[tuple[bytes, np.ndarray, Future[int]]]) -> None:
        """Serve reads in the order queued; runs of consecutive slots in one preadv each."""
        with self._env.begin() as txn:
            raws = [txn.get(key, db=self._meta) for key, _, _ in jobs]
        found: list[tuple[BlockRecord, np.ndarray, Future[int]]] = []
        for (key, dst, fut), raw in zip(jobs, raws):
            try:
                found.append((self._record(key, raw, dst), dst, fut))
            except Exception as exc:   # Corrupt: the caller's to handle
                fut.set_exception(exc)
        start = 0
        while start < len(found):
            end = start + 1
            first = found[start][0]
            while end < len(found) and first.length % ALIGN == 0 and found[end][0].length == first.length \
                    and found[end][0].slot == first.slot + (end - start):
                end += 1
            self._read_run(found[start:end])
            start = end

    def _read_run(self, run: list[tuple[BlockRecord, np.ndarray, Future[int]]]) -> None:
        got = 0
        if len(run) > 1:
            # a failed or short merged read: the blocks it did not cover are read again alone,
            # which reports each one's error
            with contextlib.suppress(Exception):
                got = self._file(run[0][0].length).read_run(run[0][0].slot, [dst for _, dst, _ in run])
        for k, (rec, dst, fut) in enumerate(run):
            try:
                check = self._verified(rec, dst) if got >= (k + 1) * rec.length else self._read_payload(rec, dst)
            except Exception as exc:   # Corrupt, or anything that broke the read: the caller's to handle
                fut.set_exception(exc)
            else:
                fut.set_result(check)

    def _read(self, key: bytes, dst: np.ndarray) -> int:
        with self._env.begin() as txn:
            raw = txn.get(key, db=self._meta)
        return self._read_payload(self._record(key, raw, dst), dst)

    @staticmethod
    def _record(key: bytes, raw: bytes | None, dst: np.ndarray) -> BlockRecord:
        if raw is None:
            raise Corrupt("block missing on disk")
        rec = decode_meta(bytes(raw), key)
        if dst.nbytes != rec.length:
            raise Corrupt(f"payload has {rec.length} bytes, expected {dst.nbytes}")
        return rec

    def _read_payload(self, rec: BlockRecord, dst: np.ndarray) -> int:
        try:
            n = self._file(rec.length).read(rec.slot, dst)
        except OSError as exc:
            raise Corrupt(f"payload read failed: {exc.strerror or exc}") from None
        if n != rec.length:
            raise Corrupt(f"payload truncated: {n} of {rec.length} bytes")
        return self._verified(rec, dst)

    def _verified(self, rec: BlockRecord, dst: np.ndarray) -> int:
        if checksum(dst) != rec.checksum:
            with self._reads_lock:   # read threads count at once
                self.checksum_failures += 1
            raise Corrupt("checksum mismatch")
        return rec.checksum

    def scan(self) -> Iterator[BlockRecord | tuple[bytes, str]]:
        """Every block record, or (db key, reason) for a record that cannot be decoded."""
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._meta):
                try:
                    yield decode_meta(bytes(raw), bytes(key))
                except Corrupt as exc:
                    yield bytes(key), str(exc)

    def namespaces(self) -> dict[int, bytes]:
        with self._env.begin() as txn:
            return {int.from_bytes(k, "big"): bytes(v) for k, v in txn.cursor(db=self._namespaces)}

    def reader_check(self) -> int:
        """Clear reader slots left by dead threads or processes; returns how many."""
        return int(self._env.reader_check())

    def file_bytes(self) -> int:
        """Bytes the tier's files take on disk (payload files and the index)."""
        return sum(f.stat().st_blocks * 512 for f in self.path.iterdir() if f.is_file())

    def close(self) -> None:
        """Finish queued writes, then close everything."""
        try:
            self._ops.put(None)
            self._writer.join()
            self._hasher.shutdown(wait=True)
            self.stop_reads()
            self._env.close()
            for f in self._files.values():
                f.close()
        finally:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)


def _settle(fut: Future[Any], exc: Exception | None, result: int | None = None) -> None:
    """Complete a caller's future (started when the writer took it) with ``exc`` or ``result``
    unless the caller gave up on it before (cancelled)."""
    if fut.done():
        return
    if fut.running() or fut.set_running_or_notify_cancel():
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)


def _commit_error(exc: BaseException) -> SSDError:
    return MapFull("LMDB map full") if isinstance(exc, lmdb.MapFullError) else SSDError(str(exc))


def _size(op: _Op) -> int:
    return (op.payload.nbytes if op.payload is not None else 0) + len(op.meta) + len(op.key)
