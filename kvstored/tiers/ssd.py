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
with; slots nobody references are free at the next start. Every read verifies length and checksum
and reports a mismatch, never returns it. A full disk is an error (``SSDError``), never a crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import xxhash

log = logging.getLogger("kvstored.ssd")

FORMAT_VERSION = 2
ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the device's block
# version, namespace id, depth, length, checksum, slot, parent length, then the parent hash
_META = struct.Struct(">HQIQQQB")


class SSDError(Exception):
    """A write could not be completed (disk full, I/O error); nothing was stored."""


class MapFull(SSDError):
    """LMDB's map (the index) is full: evict and retry."""


class InUse(SSDError):
    """Another process has the tier's directory open: two daemons would overwrite each other's
    slots."""


_LOCK_FILE = "kvstored.lock"


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


def checksum(data: memoryview | bytes | np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]


def db_key(namespace_id: int, key: bytes) -> bytes:
    return namespace_id.to_bytes(8, "big") + key


def encode_meta(rec: BlockRecord) -> bytes:
    return _META.pack(FORMAT_VERSION, rec.namespace_id, rec.depth, rec.length, rec.checksum, rec.slot,
                      len(rec.parent)) + rec.parent


def decode_meta(raw: bytes, key: bytes) -> BlockRecord:
    try:
        version, ns, depth, length, check, slot, plen = _META.unpack_from(raw)
    except struct.error:
        raise Corrupt("meta record truncated") from None
    if version != FORMAT_VERSION:
        raise Corrupt(f"unknown format version {version}")
    parent = bytes(raw[_META.size:_META.size + plen])
    if len(parent) != plen or int.from_bytes(key[:8], "big") != ns:
        raise Corrupt("meta record does not match its key")
    return BlockRecord(ns, bytes(key[8:]), parent, depth, length, check, slot)


def _stride(length: int) -> int:
    return -(-length // ALIGN) * ALIGN


def _aligned(buf: np.ndarray) -> bool:
    return buf.ctypes.data % ALIGN == 0 and buf.nbytes % ALIGN == 0


class _SlotFile:
    """The payload file of one block size: fixed slots, an O_DIRECT and a buffered descriptor."""

    def __init__(self, path: Path, length: int, used: set[int]) -> None:
        self.length = length
        self.stride = _stride(length)
        self.buffered = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self.direct: int | None = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        except OSError:  # a filesystem without O_DIRECT (e.g. tmpfs): buffered I/O only
            self.direct = None
        top = max(used, default=-1) + 1
        self.free = sorted(set(range(top)) - used, reverse=True)
        self.top = top

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.top += 1
        return self.top - 1

    def write(self, slot: int, payload: np.ndarray) -> None:
        fd = self.direct if self.direct is not None and _aligned(payload) else self.buffered
        view = memoryview(payload).cast("B")  # type: ignore[arg-type]
        done = os.pwrite(fd, view, slot * self.stride)
        while done < len(view):  # short writes happen on some filesystems near full
            n = os.pwrite(fd, view[done:], slot * self.stride + done)
            if n == 0:
                raise OSError(28, "No space left on device")
            done += n

    def read(self, slot: int, dst: np.ndarray) -> int:
        fd = self.direct if self.direct is not None and _aligned(dst) else self.buffered
        return os.preadv(fd, [memoryview(dst).cast("B")], slot * self.stride)  # type: ignore[arg-type]

    def sync(self) -> None:
        os.fdatasync(self.buffered)

    def close(self) -> None:
        os.close(self.buffered)
        if self.direct is not None:
            os.close(self.direct)


@dataclass(slots=True)
class _Op:
    kind: str                       # "put" | "delete" | "namespace"
    key: bytes
    meta: bytes                     # "namespace": the spec; "put": filled in by the writer
    payload: np.ndarray | None      # "put": the block's bytes
    done: Future[None]
    record: BlockRecord | None = None


class SSDTier:
    """The tier's files, its writer thread and read pool. Entry points are thread-safe and
    return futures."""

    def __init__(self, path: str, map_size: int, read_threads: int = 2, sync: bool = True,
                 group_commit_bytes: int = 64 << 20) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.path)
        # The index needs ~150 bytes a block; the map is sparse address space, so generous is free.
        self.map_size = max(map_size, 1 << 20)
        self._files: dict[int, _SlotFile] = {}
        self._files_lock = threading.Lock()
        env = None
        try:
            env = self._env = lmdb.open(path, map_size=self.map_size, max_dbs=4, writemap=False, readahead=True,
                                        sync=sync, metasync=sync, max_readers=126, lock=True, subdir=True)
            self._meta = self._env.open_db(b"meta")
            self._namespaces = self._env.open_db(b"namespaces")
            used: dict[int, set[int]] = {}
            for item in self.scan():
                if isinstance(item, BlockRecord):
                    used.setdefault(item.length, set()).add(item.slot)
            for length, slots in used.items():
                self._file(length, slots)
        except BaseException:   # nothing stays open, the directory's lock included
            for f in self._files.values():
                f.close()
            if env is not None:
                env.close()
            os.close(self._lock_fd)
            raise
        self._sync = sync
        self._group_bytes = group_commit_bytes
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvstored-ssd-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="kvstored-ssd-read")
        self.write_errors = 0
        self.checksum_failures = 0

    def _file(self, length: int, used: set[int] | None = None) -> _SlotFile:
        with self._files_lock:
            f = self._files.get(length)
            if f is None:
                f = self._files[length] = _SlotFile(self.path / f"payload-{length}.dat", length, used or set())
            return f

    # -- writes (one thread owns every write) ------------------------------------------------
    def put(self, namespace_id: int, key: bytes, parent: bytes, depth: int, payload: np.ndarray) -> Future[None]:
        """Queue a block write (checksummed on the writer thread); the future fails with SSDError.
        ``payload`` must stay valid and unchanged until the future is done."""
        fut: Future[None] = Future()
        rec = BlockRecord(namespace_id, key, parent, depth, int(payload.nbytes), 0)
        self._ops.put(_Op("put", db_key(namespace_id, key), b"", payload, fut, rec))
        return fut

    def delete(self, namespace_id: int, key: bytes) -> Future[None]:
        return self.delete_raw(db_key(namespace_id, key))

    def delete_raw(self, key: bytes) -> Future[None]:
        """Delete by database key (namespace id ‖ hash), also for records that do not decode."""
        fut: Future[None] = Future()
        self._ops.put(_Op("delete", key, b"", None, fut))
        return fut

    def put_namespace(self, namespace_id: int, spec_json: bytes) -> Future[None]:
        fut: Future[None] = Future()
        self._ops.put(_Op("namespace", namespace_id.to_bytes(8, "big"), spec_json, None, fut))
        return fut

    def _write_loop(self) -> None:
        try:
            while True:
                op = self._ops.get()
                if op is None:
                    return
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
                    return
        except BaseException:  # never die silently: queued callers would wait forever
            log.exception("SSD writer thread failed")
            while True:
                try:
                    left = self._ops.get_nowait()
                except queue.Empty:
                    return
                if left is not None:
                    _settle(left.done, SSDError("the SSD writer stopped"))

    def _commit(self, batch: list[_Op]) -> None:
        written: list[tuple[_Op, _SlotFile, int]] = []
        failed: list[tuple[_Op, Exception]] = []
        for op in batch:
            if op.kind != "put":
                continue
            assert op.record is not None and op.payload is not None, "put without a record"
            try:
                f = self._file(op.record.length)
            except OSError as exc:
                failed.append((op, SSDError(f"payload file: {exc.strerror or exc}")))
                continue
            slot = f.take()
            try:
                f.write(slot, op.payload)
            except OSError as exc:
                f.free.append(slot)
                failed.append((op, SSDError(f"payload write failed: {exc.strerror or exc}")))
                continue
            written.append((op, f, slot))   # first: an unforeseen error below gives the slot back
            rec = op.record
            try:
                op.meta = encode_meta(BlockRecord(rec.namespace_id, rec.key, rec.parent, rec.depth, rec.length,
                                                  checksum(op.payload), slot))
            except BaseException:
                for _, wf, ws in written:
                    wf.free.append(ws)
                raise
        try:
            if self._sync:
                for f in {f for _, f, _ in written}:
                    f.sync()  # payloads are on disk before any record points at them
            freed: list[tuple[_SlotFile, int]] = []
            with self._env.begin(write=True) as txn:
                for op in batch:
                    if op.kind == "delete":
                        raw = txn.pop(op.key, db=self._meta)
                        if raw is not None:
                            try:
                                old = decode_meta(bytes(raw), op.key)
                                freed.append((self._file(old.length), old.slot))
                            except Corrupt:
                                pass
                    elif op.kind == "namespace":
                        txn.put(op.key, op.meta, db=self._namespaces)
                for op, _, _ in written:
                    previous = txn.get(op.key, db=self._meta)
                    if previous is not None:  # the same block written again: free the old slot
                        try:
                            old = decode_meta(bytes(previous), op.key)
                            freed.append((self._file(old.length), old.slot))
                        except Corrupt:
                            pass
                    txn.put(op.key, op.meta, db=self._meta)
        except BaseException as exc:
            for _, f, slot in written:   # nothing committed: no record points at them
                f.free.append(slot)
            if not isinstance(exc, (lmdb.Error, OSError)):
                raise                    # _write_loop fails the batch
            self.write_errors += len(written) + len(failed)
            error: SSDError = MapFull("LMDB map full") if isinstance(exc, lmdb.MapFullError) else SSDError(str(exc))
            log.warning("SSD commit of %d op(s) failed: %s", len(batch), exc)
            for op in batch:
                _settle(op.done, error)
            return
        for f, slot in freed:  # reusable only now that no committed record points at them
            f.free.append(slot)
        self.write_errors += len(failed)
        if failed:
            log.warning("SSD write of %d block(s) failed: %s", len(failed), failed[0][1])
        failed_ops = {id(op) for op, _ in failed}
        for op, why in failed:
            _settle(op.done, why)
        for op in batch:
            if id(op) not in failed_ops:
                _settle(op.done, None)

    # -- reads -------------------------------------------------------------------------------
    def read_into(self, namespace_id: int, key: bytes, dst: np.ndarray) -> Future[None]:
        """Copy a block's payload into ``dst`` (uint8) on a read thread, verifying its length and
        checksum against its meta record; the future fails with Corrupt on any mismatch."""
        return self._readers.submit(self._read, db_key(namespace_id, key), dst)

    def _read(self, key: bytes, dst: np.ndarray) -> None:
        with self._env.begin() as txn:
            raw = txn.get(key, db=self._meta)
        if raw is None:
            raise Corrupt("block missing on disk")
        rec = decode_meta(bytes(raw), key)
        if dst.nbytes != rec.length:
            raise Corrupt(f"payload has {rec.length} bytes, expected {dst.nbytes}")
        try:
            n = self._file(rec.length).read(rec.slot, dst)
        except OSError as exc:
            raise Corrupt(f"payload read failed: {exc.strerror or exc}") from None
        if n != rec.length:
            raise Corrupt(f"payload truncated: {n} of {rec.length} bytes")
        if checksum(dst) != rec.checksum:
            self.checksum_failures += 1
            raise Corrupt("checksum mismatch")

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
            self._readers.shutdown(wait=True)
            self._env.close()
            for f in self._files.values():
                f.close()
        finally:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)


def _settle(fut: Future[None], exc: Exception | None) -> None:
    """Complete a caller's future unless the caller gave up on it (cancelled)."""
    if fut.set_running_or_notify_cancel():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


def _size(op: _Op) -> int:
    return (op.payload.nbytes if op.payload is not None else 0) + len(op.meta) + len(op.key)
