"""The SSD tier: block payloads in LMDB, written by one thread with group commit.

Two named databases share every key (``namespace id ‖ block hash``): ``blocks`` holds the raw
payload and ``meta`` a small record (format version, namespace, parent hash, depth, length,
checksum). Both are written in the same transaction, so a crash leaves either both or neither;
keeping the header in ``meta`` rather than in front of the payload lets a 2 MiB block go to disk
without being copied once more, and lets a restart rebuild the index by scanning only ``meta``.
Every read verifies length and checksum; a mismatch is reported, never returned.
``writemap`` stays off so a full disk is an error, not a crash.
"""

from __future__ import annotations

import logging
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

FORMAT_VERSION = 1
# version, namespace id, depth, length, checksum, parent length, then the parent hash
_META = struct.Struct(">HQIQQB")


class SSDError(Exception):
    """A write could not be committed (map or disk full, I/O error); nothing was stored."""


class MapFull(SSDError):
    """LMDB's map is full: evict and retry."""


class Corrupt(Exception):
    """A stored payload failed its length or checksum check."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What ``meta`` says about one stored block."""

    namespace_id: int
    key: bytes            # the block hash (without the namespace prefix)
    parent: bytes         # the parent's block hash, b"" for a root block
    depth: int            # index of the block in its chain (0 = first block)
    length: int
    checksum: int


def checksum(data: memoryview | bytes | np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]


def db_key(namespace_id: int, key: bytes) -> bytes:
    return namespace_id.to_bytes(8, "big") + key


def encode_meta(rec: BlockRecord) -> bytes:
    return _META.pack(FORMAT_VERSION, rec.namespace_id, rec.depth, rec.length, rec.checksum,
                      len(rec.parent)) + rec.parent


def decode_meta(raw: bytes, key: bytes) -> BlockRecord:
    version, ns, depth, length, check, plen = _META.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise Corrupt(f"unknown format version {version}")
    parent = bytes(raw[_META.size:_META.size + plen])
    if len(parent) != plen or int.from_bytes(key[:8], "big") != ns:
        raise Corrupt("meta record does not match its key")
    return BlockRecord(ns, bytes(key[8:]), parent, depth, length, check)


@dataclass(slots=True)
class _Op:
    kind: str                       # "put" | "delete" | "namespace"
    key: bytes
    meta: bytes                     # "namespace": the spec; "put": filled in by the writer
    payload: object                 # "put": a buffer
    done: Future[None]
    record: BlockRecord | None = None


class SSDTier:
    """LMDB environment, its writer thread and read pool. Thread-safe entry points return futures."""

    def __init__(self, path: str, map_size: int, read_threads: int = 2, sync: bool = True,
                 group_commit_bytes: int = 64 << 20) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = path
        self.map_size = map_size
        self._env = lmdb.open(path, map_size=map_size, max_dbs=4, writemap=False, readahead=True,
                              sync=sync, metasync=sync, max_readers=126, lock=True, subdir=True)
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._namespaces = self._env.open_db(b"namespaces")
        self._group_bytes = group_commit_bytes
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvstored-ssd-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="kvstored-ssd-read")
        self.write_errors = 0
        self.checksum_failures = 0

    # -- writes (one thread owns every write transaction) ------------------------------------
    def put(self, namespace_id: int, key: bytes, parent: bytes, depth: int, payload: np.ndarray) -> Future[None]:
        """Queue a block write (checksummed on the writer thread); the future fails with MapFull
        or SSDError. ``payload`` must stay valid and unchanged until the future is done."""
        fut: Future[None] = Future()
        rec = BlockRecord(namespace_id, key, parent, depth, int(payload.nbytes), 0)
        self._ops.put(_Op("put", db_key(namespace_id, key), b"", payload, fut, rec))
        return fut

    def delete(self, namespace_id: int, key: bytes) -> Future[None]:
        fut: Future[None] = Future()
        self._ops.put(_Op("delete", db_key(namespace_id, key), b"", None, fut))
        return fut

    def put_namespace(self, namespace_id: int, spec_json: bytes) -> Future[None]:
        fut: Future[None] = Future()
        self._ops.put(_Op("namespace", namespace_id.to_bytes(8, "big"), spec_json, None, fut))
        return fut

    def _write_loop(self) -> None:
        try:
            self._write_forever()
        except BaseException:  # never die silently: queued callers would wait forever
            log.exception("SSD writer thread failed")
            self._fail_pending(SSDError("the SSD writer stopped"))

    def _fail_pending(self, exc: Exception) -> None:
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return
            if op is not None:
                _settle(op.done, exc)

    def _write_forever(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            batch = [op]
            size = _size(op)
            # Group commit: everything already queued (up to a byte budget) shares one fsync.
            while size < self._group_bytes:
                try:
                    nxt = self._ops.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._commit(batch)
                    return
                batch.append(nxt)
                size += _size(nxt)
            self._commit(batch)

    def _commit(self, batch: list[_Op]) -> None:
        try:
            with self._env.begin(write=True) as txn:
                for op in batch:
                    if op.kind == "put":
                        assert op.record is not None, "put without a record"
                        if not op.meta:
                            rec = op.record
                            op.meta = encode_meta(BlockRecord(rec.namespace_id, rec.key, rec.parent, rec.depth,
                                                              rec.length, checksum(op.payload)))  # type: ignore[arg-type]
                        txn.put(op.key, op.payload, db=self._blocks)  # type: ignore[arg-type]
                        txn.put(op.key, op.meta, db=self._meta)
                    elif op.kind == "delete":
                        txn.delete(op.key, db=self._blocks)
                        txn.delete(op.key, db=self._meta)
                    else:
                        txn.put(op.key, op.meta, db=self._namespaces)
        except lmdb.MapFullError:
            if len(batch) > 1:  # commit what fits one by one, so one big block fails alone
                for op in batch:
                    self._commit([op])
                return
            self.write_errors += 1
            _settle(batch[0].done, MapFull("LMDB map full"))
            return
        except lmdb.Error as exc:
            self.write_errors += len(batch)
            log.warning("SSD write of %d op(s) failed: %s", len(batch), exc)
            for op in batch:
                _settle(op.done, SSDError(str(exc)))
            return
        for op in batch:
            _settle(op.done, None)

    # -- reads -------------------------------------------------------------------------------
    def read_into(self, namespace_id: int, key: bytes, dst: np.ndarray) -> Future[None]:
        """Copy a block's payload into ``dst`` (uint8) on a read thread, verifying its length and
        checksum against its meta record; the future fails with Corrupt on any mismatch."""
        return self._readers.submit(self._read, db_key(namespace_id, key), dst)

    def _read(self, key: bytes, dst: np.ndarray) -> None:
        with self._env.begin(buffers=True) as txn:
            meta = txn.get(key, db=self._meta)
            raw = txn.get(key, db=self._blocks)
            if meta is None or raw is None:
                raise Corrupt("block missing on disk")
            try:
                rec = decode_meta(bytes(meta), key)
            except struct.error:
                raise Corrupt("meta record truncated") from None
            if len(raw) != rec.length or dst.nbytes != rec.length:
                raise Corrupt(f"payload has {len(raw)} bytes, expected {rec.length}")
            np.copyto(dst, np.frombuffer(raw, dtype=np.uint8))
        # Checksum the copy, not the map: what the engine will read is what was verified.
        if checksum(dst) != rec.checksum:
            self.checksum_failures += 1
            raise Corrupt("checksum mismatch")

    def scan(self) -> Iterator[BlockRecord | tuple[bytes, str]]:
        """Every block record, or (db key, reason) for a record that cannot be decoded."""
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._meta):
                try:
                    yield decode_meta(raw, key)
                except (Corrupt, struct.error) as exc:
                    yield key, str(exc)

    def namespaces(self) -> dict[int, bytes]:
        with self._env.begin() as txn:
            return {int.from_bytes(k, "big"): bytes(v) for k, v in txn.cursor(db=self._namespaces)}

    def delete_raw(self, key: bytes) -> Future[None]:
        """Delete by database key (namespace id ‖ hash), for records that do not decode."""
        fut: Future[None] = Future()
        self._ops.put(_Op("delete", key, b"", None, fut))
        return fut

    def reader_check(self) -> int:
        """Clear reader slots left by dead threads or processes; returns how many."""
        return int(self._env.reader_check())

    def file_bytes(self) -> int:
        data = Path(self.path) / "data.mdb"
        return data.stat().st_size if data.exists() else 0

    def close(self) -> None:
        """Finish queued writes, then close the environment."""
        self._ops.put(None)
        self._writer.join()
        self._readers.shutdown(wait=True)
        self._env.close()


def _settle(fut: Future[None], exc: Exception | None) -> None:
    """Complete a caller's future unless the caller gave up on it (cancelled)."""
    if fut.set_running_or_notify_cancel():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


def _size(op: _Op) -> int:
    return int(getattr(op.payload, "nbytes", 0)) + len(op.meta) + len(op.key)
