"""``kvstored.Client``: the SDK an engine embeds to reuse, save and load KV blocks.

Block bytes move by memory copies into and out of the daemon's arena (or by the daemon's own
copies between it and registered engine buffers), never inside protobuf messages. The channel,
the session and error mapping are the :class:`~kvstored_client.connection.Connection`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from numpy.lib.stride_tricks import as_strided

from kvstored_client import coerce
from kvstored_client.buffers import Buffers, Registration, describe_tensors
from kvstored_client.connection import Connection
from kvstored_client.contract.errors import (
    DaemonNotRunning,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    NotFound,
    Reason,
)
from kvstored_client.contract.hashing import ChainHasher, checked_tokens
from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.runs import runs, smallest_step
from kvstored_client.fast_path import Unreachable
from kvstored_client.presence import ORDERED_LOADS, PresenceReader
from kvstored_client.results import (
    LoadResult,
    LookupResult,
    SaveResult,
    StreamOutcome,
    loaded,
    per_tier,
    reply_offsets,
    reply_tiers,
)
from kvstored_client.streams import BlockStream, LoadHandle

FIRST_HASHED = 32   # blocks a table lookup of tokens hashes first (a hasher memo group: see hashing.py)
# The daemon repeats a migration's or a flush's progress at least every 5 s: a client gives up
# after three silent intervals (or its timeout_s, when longer).
PROGRESS_IDLE_MIN_S = 15.0


def copy_rows(arena: np.ndarray, offsets: Sequence[int], rows: np.ndarray, to_arena: bool) -> None:
    """Row ``i`` of ``rows`` to (or from) the arena slot at ``offsets[i]``, one copy per run of
    slots side by side: a batch of small blocks otherwise paid a Python step per block."""
    width = rows.shape[1]
    if len(offsets) == 1:   # one block: a plain slice (bounds-checked), without the runs' numpy steps
        offset = int(offsets[0])
        if offset < 0 or offset + width > arena.size:
            raise ValueError(f"the daemon named arena slots outside its {arena.size}-byte arena")
        if to_arena:
            arena[offset: offset + width] = rows[0]
        else:
            rows[0] = arena[offset: offset + width]
        return
    offs = np.asarray(offsets, dtype=np.int64)   # a reply's repeated field read whole
    if offs.size and (offs.min() < 0 or offs.max() + width > arena.size):
        # the strided views below are not bounds-checked: a slot past the arena would be memory
        # outside it
        raise ValueError(f"the daemon named arena slots outside its {arena.size}-byte arena")
    step = smallest_step(offs, width)
    for run in runs(offs, step):
        slots = as_strided(arena[run.offset:], shape=(run.count, width), strides=(step, 1), writeable=to_arena)
        part = rows[run.start: run.start + run.count]
        if to_arena:
            np.copyto(slots, part)
        else:
            np.copyto(part, slots)


class Client(Connection):
    """A connection to the local kvstored daemon.

    ``Client()`` connects to the daemon on its default socket and works in the default namespace,
    whose block payload size is fixed by its first save. Engines pass their own
    :class:`Namespace` (model, dtype, block size, layout, shard) so their blocks never mix with
    anyone else's. Token counts that are not whole blocks are fine: the partial tail is ignored.
    ``cache_salt`` salts the keys of every call that passes tokens (a call's own ``cache_salt``
    replaces it; ``""`` is no salt), so tenants cannot probe each other's prefixes; calls that pass
    an engine's ``hashes`` take them as they are (the engine hashed with its salt).
    Raises :class:`DaemonNotRunning` when nothing answers on the socket.

    The hot calls (lookup, save and load, save_blocks/load_blocks with ``wait``, prefetch, stats)
    take the daemon's fast path (plain frames on its second Unix socket) when it offers one and
    gRPC otherwise, with the same errors and deadlines (``transport`` says which);
    ``fast_path=False`` (or ``KVSTORED_FAST_PATH=0``) keeps every call on gRPC.
    """

    def __init__(self, socket: str | None = None, *, namespace: Namespace | None = None,
                 client_name: str = "kvstored-python", timeout_s: float = 30.0,
                 cache_salt: str | None = None, fast_path: bool | None = None) -> None:
        super().__init__(socket, namespace, client_name, timeout_s, fast_path)
        self._cache_salt = cache_salt
        self._hashers: dict[tuple[int, str, str], ChainHasher] = {}
        self._stream_ids = itertools.count(1)   # next() is atomic under the GIL: threads may share it
        self.table_loads = 0   # loads read without a lease, from the presence table (see load)
        self.table_saves = 0   # saves answered from the presence table: every block cached (see save)
        self.committed_saves = 0   # saves made in one call, through the session's spare slots (see save)

    # -- keys ---------------------------------------------------------------------------------
    def _keys(self, into: pb.BlockKeys, spec: Namespace, tokens: Any, hashes: Sequence[bytes] | None,
              cache_salt: str | None) -> int:
        """Put the chain's keys into ``into`` (the request's own field: a BlockKeys built apart and
        copied in cost more than the rest of a 128k-token request): as ``packed_hashes``, one field
        instead of one per block, when the daemon takes them, else as ``hashes``. Returns how many
        blocks. InvalidArgument for bad tokens or hashes."""
        if hashes is not None:
            if tokens is not None:
                raise InvalidArgument("give tokens or hashes, not both")
            # the client's own salt (from its construction) is for the calls that pass tokens: a
            # salted client's hashes= calls work; a salt given with the hashes themselves is a mistake
            if cache_salt:
                raise InvalidArgument("cache_salt applies to tokens; engine hashes already include it")
            if isinstance(hashes, (bytes, bytearray, str)):
                raise InvalidArgument("hashes must be a sequence of bytes objects, one per block")
            chain = hashes if isinstance(hashes, (list, tuple)) else list(hashes)
            try:
                packed = b"".join(chain)
            except TypeError as exc:
                raise InvalidArgument(f"hashes must be a sequence of bytes objects, one per block: {exc}") from None
            size = spec.digest_size
            # every length is checked: all at least ``size`` and ``size`` on average means all equal
            if len(packed) != size * len(chain) or (chain and min(map(len, chain)) != size):
                i, bad = next(((i, h) for i, h in enumerate(chain) if len(h) != size), (-1, b""))
                if i < 0:   # len() is not the byte count (e.g. an array of 2-byte items)
                    raise InvalidArgument("hashes must be a sequence of bytes objects, one per block")
                raise InvalidArgument(f"hashes[{i}] has {len(bad)} bytes; {spec.hash_algo} keys have {size}")
            self._put_keys(into, packed, chain)
            return len(chain)
        if tokens is None:
            raise InvalidArgument("give tokens or hashes")
        salt = cache_salt if cache_salt is not None else self._cache_salt
        try:
            chain = self._hasher(spec).hashes(coerce.token_array(tokens), cache_salt=salt or None)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self._put_keys(into, b"".join(chain), chain)
        return len(chain)

    def _hasher(self, spec: Namespace) -> ChainHasher:
        """The namespace's chain hasher (one per block size, seed and algorithm, with its memo);
        InvalidArgument for an unknown algorithm."""
        key = (spec.block_size, spec.hash_seed, spec.hash_algo)
        hasher = self._hashers.get(key)
        if hasher is None:
            try:
                hasher = self._hashers[key] = ChainHasher(*key)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        return hasher

    def _put_keys(self, into: pb.BlockKeys, packed: bytes, chain: Sequence[bytes]) -> None:
        if self._packed_keys:
            into.packed_hashes = packed
        else:   # a daemon from before packed keys would see none
            into.hashes.extend(bytes(h) for h in chain)

    # -- reuse --------------------------------------------------------------------------------
    def lookup(self, tokens: Any = None, *, hashes: Sequence[bytes] | None = None,
               namespace: Namespace | None = None, cache_salt: str | None = None,
               peers: bool = False) -> LookupResult:
        """How many leading tokens of a prompt are cached, and on which tiers. Nothing is leased
        or stored; blocks of the prefix found only on SSD start moving to DRAM in the background
        (as ``prefetch`` does), and the lookup counts as a use of the prefix for eviction.

        With ``peers`` the daemon also asks its peers for the blocks after its own prefix:
        ``per_peer`` says how many each holds, and the best one's run counts as tier "peer"."""
        self._saves_answered()
        ns_id, spec = self._ns(namespace)
        if tokens is not None and hashes is None and not peers and self._packed_keys \
                and (reader := self._presence_reader()) is not None:
            answered = self._lookup_hashing_to_the_miss(reader, ns_id, spec, tokens, cache_salt)
            if answered is not None:
                return answered
        request = pb.LookupRequest(namespace_id=ns_id, peers=peers, packed_reply=True)
        n = self._keys(request.keys, spec, tokens, hashes, cache_salt)
        if not peers and 0 < n <= self._hello.max_batch_blocks and self._packed_keys \
                and (reader := self._presence_reader()) is not None:
            # Answered here from the daemon's table (read first: an answer read while its daemon
            # was there); the lookup goes to the daemon one-way, for its policy and promotions,
            # and a send that fails means the daemon is gone: the call says how, as it always did.
            found = reader.lookup(ns_id, request.keys.packed_hashes, spec.digest_size)
            if found is not None and self._tell(reader, request):
                hits, ssd = found
                tiers = {"dram": hits - ssd} if hits > ssd else {}
                if ssd:
                    tiers["ssd"] = ssd
                return LookupResult(hits * spec.block_size, hits, tiers, {})
        resp = self._call(self._stub.Lookup, request)
        return LookupResult(resp.hit_blocks * spec.block_size, resp.hit_blocks, per_tier(reply_tiers(resp)),
                            {h.node_id: h.blocks for h in resp.peer_hits})

    def _lookup_hashing_to_the_miss(self, reader: PresenceReader, ns_id: int, spec: Namespace, tokens: Any,
                                    cache_salt: str | None) -> LookupResult | None:
        """:meth:`lookup` of a prompt's tokens from the presence table, hashing only as far as
        the cached prefix goes: the first FIRST_HASHED blocks, then four times as many each time
        the table holds all of those, so that a new prompt costs a few dozen hashes instead of
        one per block (a chain cannot be hashed faster than one block after the other). The
        daemon is told the keys hashed and the prompt's length. None when the table cannot
        answer (the caller takes the whole path, which raises what it raises)."""
        salt = cache_salt if cache_salt is not None else self._cache_salt
        bs = spec.block_size
        try:
            toks = checked_tokens(coerce.token_array(tokens))   # all of them, as the whole path would
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        hasher = self._hasher(spec)
        n = toks.size // bs
        if not 0 < n <= self._hello.max_batch_blocks:
            return None
        upto = min(n, FIRST_HASHED)
        while True:
            chain = hasher.hashes(toks[: upto * bs], cache_salt=salt or None)
            packed = b"".join(chain)
            found = reader.lookup(ns_id, packed, spec.digest_size)
            if found is None:
                return None
            if found[0] < upto or upto == n:
                break
            upto = min(n, upto * 4)
        request = pb.LookupRequest(namespace_id=ns_id, packed_reply=True, prompt_blocks=n)
        self._put_keys(request.keys, packed, chain)
        if not self._tell(reader, request):
            return None
        hits, ssd = found
        tiers = {"dram": hits - ssd} if hits > ssd else {}
        if ssd:
            tiers["ssd"] = ssd
        return LookupResult(hits * bs, hits, tiers, {})

    def _tell(self, reader: PresenceReader, request: pb.LookupRequest) -> bool:
        """Send a lookup the table answered to the daemon one-way (for its policy and its
        promotions); False, the table dropped, when its daemon is gone: the caller takes the
        call, which says how, as it always did."""
        frame = reader.frame(request)
        try:
            # on the connection this thread's next call takes (served before it), unless none is
            # idle; the table's own connection says whether its daemon is there
            if not reader.alive():
                raise ConnectionResetError(0, "the presence table's daemon is gone")
            if self._fast is None or not self._fast.send_one_way(frame):
                reader.tell(frame)
        except OSError:
            self._presence_gone(reader)
            return False
        return True

    def save(self, tokens: Any, kv: Any, *, hashes: Sequence[bytes] | None = None,
             namespace: Namespace | None = None, cache_salt: str | None = None,
             push_to: str = "", start: int = 0, wait: bool = True) -> SaveResult:
        """Store a prompt's KV: ``kv`` has one row per whole block (numpy array or CPU tensor).

        Blocks already cached are skipped; when the DRAM tier cannot make room, a shorter prefix
        is stored (``stored`` says how much). One call (a Commit): the rows are copied into spare
        slots the session holds, then named (``committed_saves`` counts these saves); a save the
        spares cannot hold (past ``dram.spare_bytes``, the namespace's first save, a daemon without
        spares) is a Reserve and a Seal. With
        ``push_to`` (a peer node id) the daemon also pushes the chain to that node in the
        background, in order, skipping what it holds. With ``start``, ``kv`` holds the rows of
        blocks ``start`` on: the first ``start`` blocks must be cached already, and if they are
        not, nothing is stored (``stored`` is 0, ``present`` says how many were). A save whose
        blocks the daemon's presence table shows all cached (no ``push_to``) takes no call
        (``table_saves`` counts them).

        With ``wait=False`` a one-call save returns once its rows are in the daemon's memory and
        its Commit is sent, without the answer (on the fast path; otherwise it waits): ``stored``
        then counts the blocks whose rows were handed over. The answer is read by this client's
        next call, lookup, load or stream (which so see the blocks) or :meth:`wait_saves`; blocks it did
        not store after all (a block before them left meanwhile, a failed call) are counted in
        ``lost_saved_blocks``, never raised. Other clients see the blocks once the daemon has
        served the Commit (within a round trip).
        """
        # first: a new session after a restart renews the namespace ids; and the arena goes with it
        session, arena = self._session_arena()
        assert arena is not None, "an arena comes with the session when asked for"
        ns_id, spec = self._ns(namespace)
        reserve = pb.ReserveRequest(session_id=session, namespace_id=ns_id)
        n_blocks = self._keys(reserve.keys, spec, tokens, hashes, cache_salt)
        rows = coerce.rows(kv)
        start = coerce.block_start(start)
        if rows.shape[0] < n_blocks - start:
            raise InvalidArgument(f"kv has {rows.shape[0]} rows for {n_blocks - start} blocks")
        if n_blocks <= start:
            return SaveResult(0, 0, spec.block_size)
        seen = 0   # leading blocks the daemon's table shows cached
        if not push_to and spec.block_bytes == rows.shape[1] and n_blocks <= self._hello.max_batch_blocks \
                and self._packed_keys and (reader := self._presence_reader()) is not None:
            # Every block cached already (the daemon's table says so, read while it was there):
            # nothing to reserve or seal, and the answer a Reserve would give (a save's blocks
            # already cached are not a use of them for the policies)
            found = reader.lookup(ns_id, reserve.keys.packed_hashes, spec.digest_size)
            if found is not None and reader.alive():
                if found[0] == n_blocks:
                    self.table_saves += 1
                    return SaveResult(n_blocks, 0, spec.block_size)
                seen = found[0]
        if not push_to and spec.block_bytes == rows.shape[1] and n_blocks <= self._hello.max_batch_blocks \
                and self._spares.usable(session):
            done = self._save_by_commit(session, arena, ns_id, spec, reserve.keys, rows, n_blocks, start, seen,
                                        wait)
            if done is not None:
                return done
        reserve.block_bytes = rows.shape[1]
        resp = self._call(self._stub.Reserve, reserve)
        if spec.block_bytes == 0:
            self._namespace_ids.pop(namespace or self.namespace, None)  # learn the fixed size
        first = resp.present_blocks
        if first < start:
            # rows for the missing leading blocks are not ours to give: store none of the chain
            self._release_now(session, resp.reservation_id)
            return SaveResult(first, 0, spec.block_size)
        try:
            with self._writing_arena():
                copy_rows(arena, resp.offsets, rows[first - start:], to_arena=True)
        except BaseException:
            # interrupted (KeyboardInterrupt, a bad row): the reservation would keep other writers
            # of this prefix waiting until it expires
            self._release_now(session, resp.reservation_id)
            raise
        try:
            sealed = self._call(self._stub.Seal, pb.SealRequest(
                session_id=session, reservation_id=resp.reservation_id, push_to=push_to)).sealed_blocks
        except BaseException:
            # interrupted, or no answer (a deadline): the reservation would keep other writers of this
            # prefix waiting until it expires. Sent in the background: releasing one the seal (or
            # the daemon) ended already is a no-op
            self._release_later(session, resp.reservation_id)
            raise
        return SaveResult(first, sealed, spec.block_size)

    def _save_by_commit(self, session: str, arena: np.ndarray, ns_id: int, spec: Namespace, keys: pb.BlockKeys,
                        rows: np.ndarray, n_blocks: int, start: int, seen: int, wait: bool) -> SaveResult | None:
        """:meth:`save` in one call: the rows of the blocks after the ``seen`` cached ones go into
        spare slots, and one Commit names the blocks (the call also tops the spares up; the first
        save of a size asks for them first). None when the session cannot hold the spares such a
        save needs, or a block the table showed cached left before the Commit: the save then
        takes a reservation."""
        first = max(seen, start)
        need = n_blocks - first
        want = self._spares.wanted(spec.block_bytes, need)
        if need <= 0 or not want:
            return None
        taken = self._spares.take(session, spec.block_bytes, need)
        behind = self._write_behind
        # the oldest answers give slots back; reading only as many as it takes keeps the
        # others (and the daemon's work on them) going while this save copies its rows
        while taken is None and behind is not None and behind.settle_oldest():
            taken = self._spares.take(session, spec.block_bytes, need)
        if taken is None:
            granted = self._call(self._stub.Commit, pb.CommitRequest(
                session_id=session, namespace_id=ns_id, block_bytes=spec.block_bytes, spares_wanted=want))
            self._spares.give(session, spec.block_bytes, granted.spare_offsets)
            taken = self._spares.take(session, spec.block_bytes, need)
            if taken is None:
                return None
        try:
            with self._writing_arena():
                copy_rows(arena, taken, rows[first - start:], to_arena=True)
        except BaseException:
            self._spares.give(session, spec.block_bytes, taken)   # not named to the daemon: still spare
            raise
        # No answer (a deadline, an interrupt): the daemon may have bound the slots to blocks, so
        # they are not given back (they are free again when the session ends).
        commit = pb.CommitRequest(session_id=session, namespace_id=ns_id, keys=keys, first=first, offsets=taken,
                                  block_bytes=spec.block_bytes, spares_wanted=want)
        if not wait and behind is not None:
            try:
                behind.send(commit, spec.block_bytes, need, self._timeout)
            except grpc.RpcError as exc:
                raise self._error(exc) from None
            except Unreachable:
                pass   # the fast socket is gone: the call below takes gRPC
            else:
                self.committed_saves += 1
                return SaveResult(first, need, spec.block_size)
        done = self._call(self._stub.Commit, commit)
        self._spares.give(session, spec.block_bytes, done.spare_offsets)
        if done.present_blocks < first and first > start:
            return None   # a block the table showed cached left meanwhile: its row is the reservation's to write
        self.committed_saves += 1
        return SaveResult(done.present_blocks, done.stored_blocks, spec.block_size)

    def wait_saves(self) -> None:
        """Return once the daemon has answered every save sent with ``wait=False``: their blocks
        are cached (or counted in ``lost_saved_blocks``)."""
        self._check_open()
        self._saves_answered()

    @property
    def saves_in_flight(self) -> int:
        """Saves sent with ``wait=False`` whose answers this client has not read yet."""
        return 0 if self._write_behind is None else len(self._write_behind)

    @property
    def lost_saved_blocks(self) -> int:
        """Blocks of saves sent with ``wait=False`` that their answers showed not stored (a block
        before them had left, the call failed: ``save_errors``)."""
        return 0 if self._write_behind is None else self._write_behind.lost_blocks

    @property
    def save_errors(self) -> int:
        """Saves sent with ``wait=False`` that failed (the last one's error: ``last_save_error``)."""
        return 0 if self._write_behind is None else self._write_behind.failed

    @property
    def last_save_error(self) -> KVStoreError | None:
        return None if self._write_behind is None else self._write_behind.last_error

    def load(self, tokens: Any = None, *, hashes: Sequence[bytes] | None = None, out: Any = None,
             dtype: Any = None, namespace: Namespace | None = None,
             cache_salt: str | None = None, start: int = 0) -> LoadResult:
        """Read the KV of the longest cached prefix, one row per block.

        With ``out`` (an array or tensor with a row per block, e.g. reused between calls) rows
        are copied into it and ``data`` is a view of its first rows (rows past those may have been
        written too: a read without a lease that raced with an eviction, taken again under a
        lease, can come back shorter); otherwise a new uint8 array
        (or ``dtype``) is returned. With ``start`` (blocks the caller holds already) only the rows
        of blocks ``start`` on are read; ``blocks`` still counts the whole cached prefix. Raises
        LeaseExpired if the read outlived its lease; bad ``out``/``dtype`` raise InvalidArgument
        (nothing stays leased).

        Blocks the daemon's presence table shows in DRAM are read without a call (x86-64 only):
        copied, then checked still to be those blocks' bytes (the table's where words, read
        again), and the lookup told to the daemon one-way as a table lookup's is; any other
        case, or a block that changed meanwhile, takes the leased lookup. ``table_loads`` counts
        the loads read without a lease; the switches of table lookups turn it off too
        (``fast_path=False``, ``KVSTORED_PRESENCE_TABLE=0``; see ``lookup_transport``).
        """
        self._saves_answered()
        # first: a new session after a restart renews the namespace ids; and the arena goes with it
        session, arena = self._session_arena()
        assert arena is not None, "an arena comes with the session when asked for"
        entry = self._ns(namespace)
        ns_id, spec = entry
        start = coerce.block_start(start)
        lookup = pb.LookupRequest(namespace_id=ns_id, packed_reply=True)
        n = self._keys(lookup.keys, spec, tokens, hashes, cache_salt)
        out_rows = None if out is None else coerce.writable_rows(out)
        try:
            row_type = None if dtype is None else np.dtype(dtype)
        except TypeError as exc:
            raise InvalidArgument(f"dtype: {exc}") from None
        if row_type is not None and (row_type.itemsize == 0 or row_type.hasobject):
            # a view of the rows as these is impossible (ZeroDivisionError, TypeError from numpy)
            raise InvalidArgument(f"dtype: {row_type} is not a fixed-size type of numbers that rows of bytes "
                                  "can be viewed as")
        if out_rows is not None and spec.block_bytes and out_rows.shape[1] != spec.block_bytes:
            raise InvalidArgument(f"out has rows of {out_rows.shape[1]} bytes; blocks of this namespace have "
                                  f"{spec.block_bytes}")
        if ORDERED_LOADS and spec.block_bytes and 0 < n <= self._hello.max_batch_blocks and self._packed_keys \
                and (reader := self._presence_reader()) is not None:
            done = self._load_from_table(reader, lookup, spec, start, out, out_rows, row_type)
            if done is not None:
                return done
        lookup.lease = True
        lookup.session_id = session
        started = time.monotonic()
        resp = self._call(self._stub.Lookup, lookup)
        self._learned_block_bytes(namespace, entry, resp.block_bytes)   # the next load may read the table
        hit = resp.hit_blocks
        wanted = max(hit - start, 0)
        if not wanted:   # rows as wide as the namespace's blocks (0 while its size is unknown)
            if hit:
                self._release_later(session, resp.lease_id)
            if out is not None:
                return LoadResult(hit * spec.block_size, hit, out[:0])
            empty = np.empty((0, resp.block_bytes), np.uint8)
            return LoadResult(hit * spec.block_size, hit,
                              empty if row_type is None or resp.block_bytes % row_type.itemsize
                              else empty.view(row_type))
        block_bytes = resp.block_bytes
        try:
            if out_rows is not None:
                rows = out_rows
                if rows.shape[0] < wanted or rows.shape[1] != block_bytes:
                    raise InvalidArgument(f"out has rows of {rows.shape[1]} bytes x {rows.shape[0]}; "
                                          f"need {wanted} rows of {block_bytes} bytes")
                data = out[:wanted]
            else:
                rows = np.empty((wanted, block_bytes), dtype=np.uint8)
                if row_type is not None and block_bytes % row_type.itemsize:
                    raise InvalidArgument(f"a block of {block_bytes} bytes is not a whole number of "
                                          f"{row_type} items")
                data = rows if row_type is None else rows.view(row_type)
            copy_rows(arena, reply_offsets(resp)[start:hit], rows[:wanted], to_arena=False)
        except BaseException:
            self._release_now(session, resp.lease_id)
            raise
        # The daemon's deadline is at least ttl after our request left: well inside it, the
        # bytes were pinned for the whole copy and the release need not be waited for.
        if time.monotonic() - started < resp.lease_ttl_ms / 2000:
            self._release_later(session, resp.lease_id)
        else:
            try:
                self._call(self._stub.Release, pb.ReleaseRequest(session_id=session, lease_id=resp.lease_id))
            except KVStoreError as exc:
                raise LeaseExpired(f"the read took longer than its lease: {exc}") from None
        return LoadResult(hit * spec.block_size, hit, data)

    def _load_from_table(self, reader: PresenceReader, lookup: pb.LookupRequest, spec: Namespace, start: int,
                         out: Any, out_rows: np.ndarray | None, row_type: np.dtype[Any] | None) -> LoadResult | None:
        """``load`` without a lease (see there), or None: the caller takes the leased lookup."""
        arena = self._table_arena(reader)
        if arena is None:
            return None
        located = reader.locate(lookup.namespace_id, lookup.keys.packed_hashes, spec.digest_size, start)
        if located is None:
            return None
        hit = located.hits
        wanted = max(hit - start, 0)
        block_bytes = spec.block_bytes
        if out_rows is not None:
            if out_rows.shape[0] < wanted:
                return None   # the leased path says what is wrong, as it always did
            rows = out_rows
            data = out[:wanted]
        else:
            if row_type is not None and block_bytes % row_type.itemsize:
                return None
            rows = np.empty((wanted, block_bytes), dtype=np.uint8)
            data = rows if row_type is None else rows.view(row_type)
        if wanted:
            try:
                copy_rows(arena, located.offsets, rows[:wanted], to_arena=False)
            except ValueError:
                return None   # (offsets outside the arena: not this daemon's table after all)
            if not reader.confirm(located):
                return None   # a block changed while it was copied: the lease holds them still
        if not self._tell(reader, lookup):
            return None
        self.table_loads += 1
        return LoadResult(hit * spec.block_size, hit, data)

    # -- engine buffers -------------------------------------------------------------------------
    def register_buffers(self, tensors: Sequence[Any], block_dim: int | Sequence[int] = 0, *,
                         namespace: Namespace | None = None) -> Buffers:
        """Register an engine's paged KV tensors (allocated with ``kvstored.shm.empty``).

        A block's payload is each tensor indexed at the block along ``block_dim``, in order. The
        daemon maps them and copies blocks itself in ``save_blocks``/``load_blocks``.
        """
        descs, signature = describe_tensors(tensors, block_dim)
        # The layout signature enters the namespace: blocks saved under one layout are never
        # loaded into another.
        ns = namespace or self.namespace
        if ns.layout and ns.layout != signature:
            raise InvalidArgument(f"buffers have layout {signature!r} but the namespace says {ns.layout!r}")
        ns = dataclasses.replace(ns, layout=signature)
        session = self._session()
        resp = self._register(session, ns, descs)
        return Buffers(resp.num_blocks, resp.block_bytes, resp.layout, ns, len(descs),
                       Registration(self, tuple(descs), (session, resp.buffers_id)))

    def _register(self, session: str, ns: Namespace, descs: Sequence[pb.TensorDesc]) -> pb.RegisterBuffersResponse:
        ns_id, _ = self._ns(ns)
        resp = self._call(self._stub.RegisterBuffers, pb.RegisterBuffersRequest(
            session_id=session, namespace_id=ns_id, tensors=descs))
        self._namespace_ids.pop(ns, None)   # registering may have fixed the namespace's block size
        return resp

    def _buffers_id(self, buffers: Buffers, session: str) -> int:
        """The daemon's id for ``buffers`` in ``session``, registering the tensors again when they
        were registered in an earlier session (the daemon restarted, or the session ended): a
        registration belongs to its session, and an engine registers its buffers once. One
        thread registers them again; others using the same buffers wait for it, each at most its
        ``timeout_s`` (DeadlineExceeded), and calls with other buffers do not wait at all."""
        reg = self._registration_of(buffers)
        if not reg.registered:
            raise NotFound("these buffers were unregistered", Reason.UNKNOWN_BUFFERS)
        if reg.current[0] == session:
            return reg.current[1]
        with self._holding(reg):
            if not reg.registered:
                raise NotFound("these buffers were unregistered", Reason.UNKNOWN_BUFFERS)
            if reg.current[0] != session:
                resp = self._register(session, buffers.namespace, reg.tensors)
                if (resp.num_blocks, resp.block_bytes, resp.layout) != \
                        (buffers.num_blocks, buffers.block_bytes, buffers.layout):
                    # (the tensors are the same, so only another daemon version could say so)
                    self._forget_buffers(session, resp.buffers_id)
                    raise KVStoreError(
                        f"registering the buffers again after a daemon restart gave {resp.num_blocks} blocks of "
                        f"{resp.block_bytes} B ({resp.layout}), not {buffers.num_blocks} of {buffers.block_bytes} B "
                        f"({buffers.layout}): register them anew")
                reg.current = (session, resp.buffers_id)
            return reg.current[1]

    def _registration_of(self, buffers: Buffers) -> Registration:
        reg = buffers._registration
        if reg.client is not self:
            raise InvalidArgument("these buffers were registered by another client")
        return reg

    @contextlib.contextmanager
    def _holding(self, reg: Registration) -> Iterator[None]:
        """``reg``'s lock, waited for at most ``timeout_s``: the thread holding it is in an RPC
        that may take that long, and a daemon that stops answering must give each caller
        DeadlineExceeded after its own timeout_s, not after every other thread's in turn."""
        if not reg.lock.acquire(timeout=self._timeout):
            raise DeadlineExceeded(f"kvstored on {self.socket} did not answer within {self._timeout:g} s "
                                   "(Client timeout_s) while another thread registered these buffers again")
        try:
            yield
        finally:
            reg.lock.release()

    def _forget_buffers(self, session: str, buffers_id: int) -> None:
        self._call(self._stub.UnregisterBuffers, pb.UnregisterBuffersRequest(session_id=session,
                                                                             buffers_id=buffers_id))

    def unregister_buffers(self, buffers: Buffers) -> None:
        """After this returns the daemon no longer touches the tensors; the engine may free them.

        Buffers registered in a session that has ended since (a daemon restart), or with a
        daemon that is gone or stopping (DaemonNotRunning), are only forgotten: the daemon drops
        them when the session ends. Using ``buffers`` afterwards raises NotFound."""
        reg = self._registration_of(buffers)
        with self._holding(reg):
            if not reg.registered:
                return
            with self._lock:
                current = self._session_id
            session_id, buffers_id = reg.current
            if session_id == current:
                try:
                    self._forget_buffers(session_id, buffers_id)
                except FailedPrecondition as exc:
                    # a restart this client has not noticed yet: the session, and the buffers, are gone
                    if exc.reason != Reason.UNKNOWN_SESSION:
                        raise
                except DaemonNotRunning:
                    # an engine shutting down after the daemon: the daemon is gone, or exiting
                    # (it cancels calls only then), and its mappings of the buffers with it
                    pass
            reg.registered = False

    def save_blocks(self, buffers: Buffers, block_ids: Sequence[int], tokens: Any = None, *,
                    hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
                    push_to: str = "") -> SaveResult:
        """Store blocks ``block_ids`` of the registered buffers as the prompt's chain of blocks.

        ``push_to``: also push the chain to that peer node (e.g. the decode node), in the
        background and in order; call this per chunk of prefill and each chunk leaves at once."""
        session = self._session()
        ns_id, spec = self._ns(buffers.namespace)
        request = pb.SaveBlocksRequest(session_id=session, namespace_id=ns_id,
                                       buffers_id=self._buffers_id(buffers, session), push_to=push_to)
        self._keys(request.keys, spec, tokens, hashes, cache_salt)
        coerce.set_block_ids(request, coerce.block_id_sequence(block_ids), buffers, self._packed_keys)
        resp = self._call(self._stub.SaveBlocks, request)
        return SaveResult(resp.present_blocks, resp.stored_blocks, spec.block_size)

    def load_blocks(self, buffers: Buffers, block_ids: Sequence[int], tokens: Any = None, *,
                    hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
                    wait: bool = True) -> Any:
        """Copy the cached prefix of the prompt into blocks ``block_ids``.

        Returns a LookupResult of what was loaded; with ``wait=False`` returns a
        :class:`LoadHandle` at once, whose ``wait_layer(i)`` returns when registered tensor ``i``
        is in place (compute layer i while later layers arrive) and ``wait()`` when all are.
        Blocks past the loaded prefix are left as they were, or hold their own block's bytes
        (copied as it came up from SSD before the read's lease ended, then not counted).
        """
        session = self._session()
        ns_id, spec = self._ns(buffers.namespace)
        request = pb.LoadBlocksRequest(session_id=session, namespace_id=ns_id,
                                       buffers_id=self._buffers_id(buffers, session))
        self._keys(request.keys, spec, tokens, hashes, cache_salt)
        coerce.set_block_ids(request, coerce.block_id_sequence(block_ids), buffers, self._packed_keys)
        if not wait:
            call = self._start_stream(self._stub.LoadBlocksStream, request, self._timeout)
            return LoadHandle(call, spec.block_size, buffers.num_tensors, self._error)
        resp = self._call(self._stub.LoadBlocks, request)
        return loaded(resp, spec.block_size)

    def prefetch(self, tokens: Any = None, *, hashes: Sequence[bytes] | None = None,
                 namespace: Namespace | None = None, cache_salt: str | None = None) -> LookupResult:
        """Start moving a prompt's cached blocks from slower tiers to DRAM ahead of ``load``;
        returns at once with what is cached (``per_tier['promoting']``: blocks on their way)."""
        ns_id, spec = self._ns(namespace)
        request = pb.PrefetchRequest(namespace_id=ns_id)
        self._keys(request.keys, spec, tokens, hashes, cache_salt)
        resp = self._call(self._stub.Prefetch, request)
        return LookupResult(resp.hit_blocks * spec.block_size, resp.hit_blocks,
                            {"promoting": resp.promoting_blocks} if resp.promoting_blocks else {})

    def stream(self, tokens: Any = None, *, hashes: Sequence[bytes] | None = None,
               buffers: Buffers | None = None, block_ids: Sequence[int] | None = None,
               namespace: Namespace | None = None, cache_salt: str | None = None,
               peers: bool = True) -> BlockStream:
        """Load a prompt's blocks one by one, in token order, each as soon as it is in place.

        Iterate the returned :class:`BlockStream` for :class:`BlockArrival` events: the blocks
        cached on this node first, then (``peers``) the rest as the daemon fetches them from the
        peer holding them, so decoding can start on block 0 while later blocks are in flight.
        With ``buffers``/``block_ids`` each block lands in the engine's buffers; without, each
        arrival carries the block's bytes. After the loop, ``outcome`` says how far it got and why
        it stopped; a short stream is not an error (the engine recomputes the rest).
        """
        if buffers is not None and namespace is not None and \
                dataclasses.replace(namespace, layout=buffers.layout, block_bytes=0) != \
                dataclasses.replace(buffers.namespace, block_bytes=0):
            # the buffers' namespace is the one streamed: another one (another block size, model,
            # shard) was ignored without a word
            raise InvalidArgument(f"namespace {namespace} is not the buffers' namespace {buffers.namespace}; "
                                  "a stream into buffers uses theirs (leave namespace out)")
        ns = buffers.namespace if buffers is not None else namespace
        # the arena before the call starts, and with the session: offsets go with this mapping
        session, arena = self._session_arena(buffers is None)
        ns_id, spec = self._ns(ns)
        # Into buffers: an id for EndStream, so that leaving early waits until no copy runs
        request = pb.StreamBlocksRequest(session_id=session, namespace_id=ns_id,
                                         buffers_id=0 if buffers is None else self._buffers_id(buffers, session),
                                         peers=peers, stream_id=next(self._stream_ids)
                                         if buffers is not None and self._takes_end_stream else 0)
        n_blocks = self._keys(request.keys, spec, tokens, hashes, cache_salt)
        if block_ids is not None:
            block_ids = coerce.block_id_sequence(block_ids)
        if buffers is not None and (block_ids is None or len(block_ids) != n_blocks):
            raise InvalidArgument(f"give one block id per block ({n_blocks}) with buffers")
        if buffers is None and block_ids is not None and len(block_ids):
            # (they were ignored: each block came back as bytes, none went to the engine's buffers)
            raise InvalidArgument("block_ids name blocks of registered buffers: give buffers too")
        coerce.set_block_ids(request, [] if block_ids is None else block_ids, buffers, self._packed_keys)
        started = time.monotonic()
        call = self._start_stream(self._stub.StreamBlocks, request, self._timeout)
        return BlockStream(self, session, call, arena, spec.block_size, spec.block_bytes, started,
                           lambda: self._ns(ns, learn_block_bytes=True)[1].block_bytes, request.stream_id)

    def pull(self, tokens: Any = None, *, hashes: Sequence[bytes] | None = None,
             namespace: Namespace | None = None, cache_salt: str | None = None) -> StreamOutcome:
        """Bring a prompt's blocks to this node from the peers holding them, and return when they
        are here (or the transfer stopped: the outcome says how far and why). Nothing is handed to
        the caller and nothing stays leased: a later ``load``/``stream`` finds the blocks local.
        The decode side's way to pull a prefix ahead of the request that needs it."""
        session = self._session()
        ns_id, spec = self._ns(namespace)
        request = pb.StreamBlocksRequest(session_id=session, namespace_id=ns_id, peers=True, end_only=True)
        self._keys(request.keys, spec, tokens, hashes, cache_salt)
        try:
            for event in self._start_stream(self._stub.StreamBlocks, request, self._timeout):
                if event.HasField("end"):
                    e = event.end
                    return StreamOutcome(e.blocks, e.requested, e.blocks * spec.block_size, e.stop, e.detail)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        raise KVStoreError("the pull ended without its outcome")

    # -- cluster --------------------------------------------------------------------------------
    def peers(self) -> dict[str, Any]:
        """This node and its peers as the daemon sees them (see ``kvctl peers``); asks each peer
        a quick question first, so states are fresh."""
        resp = self._call(self._stub.Peers, pb.PeersRequest())
        out = json_format.MessageToDict(resp, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
        for row in out["peers"]:   # protobuf's JSON mapping writes 64-bit integers as strings
            for key in ("blocks_fetched", "blocks_pushed"):
                row[key] = int(row[key])
        return out

    def migrate(self, to: str = "", *, model: str = "", tokens: Any = None, hashes: Sequence[bytes] | None = None,
                namespace: Namespace | None = None, drain: bool = False,
                cache_salt: str | None = None) -> Iterator[dict[str, Any]]:
        """Push a model's blocks (all models when empty), or one prompt's cached prefix (``tokens``
        or ``hashes``; a prompt of no whole block moves nothing), to node ``to``; with ``drain``
        (and no ``to``) everything goes to the peers and the local copies are dropped. Yields
        progress dicts (total_blocks, pushed_blocks, failed_blocks, dropped_blocks, detail, done).

        A generator: the migration starts when it is first iterated and runs while it is, so
        iterate it to its end (``for p in client.migrate(...)``, or ``list(...)``); closing it or
        dropping it before ``done`` cancels the migration (what was pushed stays pushed). A
        migration may take any time, but the daemon reports progress every few seconds: when
        nothing comes for ``timeout_s`` (at least 15 s), DeadlineExceeded (the migration is
        cancelled)."""
        self._check_open()
        self._settle_releases()
        request = pb.MigrateRequest(to=to, model=model, drain=drain)
        if tokens is not None or hashes is not None:
            self._session()   # the daemon's current session says whether it takes packed keys
            ns_id, spec = self._ns(namespace)
            request.prefix.SetInParent()   # present even when it names no whole block
            if not self._keys(request.prefix, spec, tokens, hashes, cache_salt):
                # nothing to move; and a daemon from before took an empty prefix for none (all)
                yield {"total_blocks": 0, "pushed_blocks": 0, "failed_blocks": 0, "dropped_blocks": 0,
                       "detail": "", "done": True}
                return
            request.namespace_id = ns_id
        for p in self._until_idle(self._start_stream(self._stub.Migrate, request, None), "migration",
                                  max(self._timeout, PROGRESS_IDLE_MIN_S)):
            yield {"total_blocks": p.total_blocks, "pushed_blocks": p.pushed_blocks,
                   "failed_blocks": p.failed_blocks, "dropped_blocks": p.dropped_blocks,
                   "detail": p.detail, "done": p.done}

    def _until_idle(self, call: Any, what: str, idle_s: float) -> Generator[Any, None, None]:
        """The messages of a server stream with no overall deadline, as they come; the call is
        cancelled and DeadlineExceeded raised when none comes for ``idle_s``."""
        inbox: queue.Queue[Any] = queue.Queue()
        end = object()

        def pump() -> None:
            try:
                for message in call:
                    inbox.put(message)
            except grpc.RpcError as exc:
                inbox.put(exc)
            inbox.put(end)

        threading.Thread(target=pump, daemon=True, name="kvstored-stream").start()
        try:
            while True:
                try:
                    item = inbox.get(timeout=idle_s)
                except queue.Empty:
                    raise DeadlineExceeded(f"kvstored on {self.socket} reported no progress of the {what} "
                                           f"for {idle_s:g} s; cancelled") from None
                if item is end:
                    return
                if isinstance(item, grpc.RpcError):
                    raise self._error(item) from None
                yield item
        finally:
            call.cancel()   # no-op once the stream has ended

    # -- admin --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The daemon's counters and per-tier usage as a plain dict (see ``kvctl stats``);
        counts are ints. Lease releases this client sent in the background are done first, so
        its own reads show as ended."""
        self._settle_releases()
        resp = self._call(self._stub.Stats, pb.StatsRequest())
        out = json_format.MessageToDict(resp, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
        # protobuf's JSON mapping writes 64-bit integers as strings; give callers numbers
        return {k: (int(v) if isinstance(v, str) and k != "version" else v) for k, v in out.items()} | {
            "tiers": [{k: (int(v) if k != "name" else v) for k, v in t.items()} for t in out["tiers"]],
            "dropped_blocks_by_reason": {k: int(v) for k, v in out.get("dropped_blocks_by_reason", {}).items()}}

    def evict(self, model: str = "", tier: str | None = None) -> int:
        """Drop cached blocks of ``model``'s namespaces (all when empty) from ``tier`` ("dram",
        "ssd", or all when None); leased blocks stay. Returns how many blocks were dropped, once
        the daemon has committed their SSD deletes (a crash after it does not bring them back).
        FailedPrecondition for "ssd" when the daemon runs without an SSD tier; NotFound for a model
        it has never seen."""
        tiers = {None: pb.TIER_UNSPECIFIED, "dram": pb.TIER_DRAM, "ssd": pb.TIER_SSD}
        if tier not in tiers:
            raise InvalidArgument(f"unknown tier {tier!r}; expected dram or ssd")
        self._settle_releases()
        return int(self._call(self._stub.Evict, pb.EvictRequest(model=model, tier=tiers[tier])).blocks)

    def flush(self, model: str = "") -> int:
        """Write every DRAM block of ``model`` (all when empty) that has no SSD copy to SSD now;
        returns how many were written. ResourceExhausted, saying how many were written and how
        many were not, when some could not be (a full SSD tier, write errors); FailedPrecondition
        when the daemon runs without an SSD tier; NotFound for a model it has never seen. Takes
        as long as the writes take (minutes for a large arena), as :meth:`flushing`."""
        written = 0
        for progress in self.flushing(model):
            written = progress["written_blocks"]
        return written

    def flushing(self, model: str = "") -> Iterator[dict[str, Any]]:
        """:meth:`flush`, yielding progress dicts (written_blocks, left_blocks: still only in DRAM,
        done) before the first write, after each write round and at the end. A generator: the
        flush runs while it is iterated, and closing or dropping it early cancels the flush. A flush may take any
        time, but the daemon reports progress every few seconds: when nothing comes for
        ``timeout_s`` (at least 15 s), DeadlineExceeded (the flush is cancelled; what was written
        stays written). A daemon from before FlushStream flushes in one call under ``timeout_s``
        and reports once, at the end."""
        self._check_open()
        progress = self._until_idle(self._start_stream(self._stub.FlushStream, pb.FlushRequest(model=model), None),
                                    "flush", max(self._timeout, PROGRESS_IDLE_MIN_S))
        try:
            first = next(progress)
        except StopIteration:
            return
        except KVStoreError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # a daemon older than FlushStream: its unary Flush, as this SDK called it before
            written = int(self._call(self._stub.Flush, pb.FlushRequest(model=model)).blocks)
            yield {"written_blocks": written, "left_blocks": 0, "done": True}
            return
        try:
            for p in itertools.chain((first,), progress):
                yield {"written_blocks": p.written_blocks, "left_blocks": p.left_blocks, "done": p.done}
        finally:
            progress.close()   # a caller that stops listening cancels the flush now
