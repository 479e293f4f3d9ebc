"""``kvstored.Client``: the SDK an engine embeds to reuse, save and load KV blocks.

One client holds one gRPC channel to the local daemon and, once needed, one session (a stream
whose end releases everything the client held) and a mapping of the daemon's DRAM arena. Block
bytes move by memory copies into and out of that arena, never inside protobuf messages.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import itertools
import math
import mmap
import os
import queue
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format

from kvstored_client import cuda_export, shm
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
from kvstored_client.contract.hashing import ChainHasher
from kvstored_client.contract.layout import TensorLayout, layout_signature
from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.paths import discover_socket_path
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc
from kvstored_client.contract.wire import namespace_from_pb, namespace_to_pb
from kvstored_client.errors import ClientClosed, from_rpc_error, reason_of

MAX_MESSAGE_BYTES = 64 << 20
# gRPC backs off reconnecting after a failed connect (1 s, growing 1.6x up to 120 s): calls made
# while the daemon restarts stretched it, and the same client kept failing with DaemonNotRunning for
# as long again after the daemon was back. The daemon is local: retrying its socket is cheap.
RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1000
# The daemon repeats a migration's or a flush's progress at least every 5 s: a client gives up
# after three silent intervals (or its timeout_s, when longer).
PROGRESS_IDLE_MIN_S = 15.0
T = TypeVar("T")
TIER_NAMES: dict[int, str] = {pb.TIER_DRAM: "dram", pb.TIER_SSD: "ssd", pb.TIER_PEER: "peer"}


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prompt is cached: leading ``tokens`` (``blocks`` whole blocks), per tier."""

    tokens: int
    blocks: int
    per_tier: dict[str, int] = field(default_factory=dict)
    per_peer: dict[str, int] = field(default_factory=dict)   # lookup(peers=True): blocks after the local prefix


@dataclass(frozen=True, slots=True)
class BlockArrival:
    """Block ``index`` of a streamed prompt is in place: in the engine's buffers (``data`` is
    None), or copied out of the daemon into ``data`` (one row of bytes). ``tier``: where it was
    found ("dram", "ssd", or "peer": fetched from node ``peer`` just now)."""

    index: int
    tier: str
    peer: str
    data: Any


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """How a stream ended: ``blocks`` of ``requested`` arrived (``tokens`` of the prompt), then
    ``stop``: "complete", or why it stopped short ("missing", "peer_closed", "timeout", "corrupt",
    "unreachable", "peer_error", "no_room", "no_peers", "lease_ended"); the engine recomputes the
    rest."""

    blocks: int
    requested: int
    tokens: int
    stop: str
    detail: str

    @property
    def complete(self) -> bool:
        return self.stop == "complete"


@dataclass(frozen=True, slots=True)
class SaveResult:
    """``present``: leading blocks that were cached already; ``stored``: blocks added now."""

    present: int
    stored: int
    block_size: int

    @property
    def tokens(self) -> int:
        """Tokens of the prompt now cached from its start."""
        return (self.present + self.stored) * self.block_size


@dataclass(frozen=True, slots=True)
class LoadResult:
    """The cached prefix: ``blocks`` rows of ``data`` (a view of ``out`` when one was given)."""

    tokens: int
    blocks: int
    data: Any


@dataclass(slots=True, eq=False)
class _Registration:
    """What ``register_buffers`` sent, and the id the daemon gave it in which session: a
    registration belongs to a session, so after a restart the SDK registers the tensors again."""

    client: Client
    tensors: tuple[pb.TensorDesc, ...]
    current: tuple[str, int]   # (session id, buffers id): one attribute, read without the lock
    registered: bool = True   # False once unregistered
    # held by the one thread registering these buffers again (or unregistering them); others wait
    # for it within their own timeout_s, never for every other thread's RPC in turn
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, slots=True, eq=False)
class Buffers:
    """A registration of engine KV tensors with the daemon. It lives through a daemon restart:
    the SDK registers the tensors again with the new daemon on their next use."""

    num_blocks: int
    block_bytes: int
    layout: str
    namespace: Namespace
    num_tensors: int
    _registration: _Registration = field(repr=False)

    @property
    def buffers_id(self) -> int:
        """The daemon's id for this registration in the client's current session."""
        return self._registration.current[1]


class Client:
    """A connection to the local kvstored daemon.

    ``Client()`` connects to the daemon on its default socket and works in the default namespace,
    whose block payload size is fixed by its first save. Engines pass their own
    :class:`Namespace` (model, dtype, block size, layout, shard) so their blocks never mix with
    anyone else's. Token counts that are not whole blocks are fine: the partial tail is ignored.
    ``cache_salt`` salts the keys of every call that passes tokens (a call's own ``cache_salt``
    replaces it; ``""`` is no salt), so tenants cannot probe each other's prefixes; calls that pass
    an engine's ``hashes`` take them as they are (the engine hashed with its salt).
    Raises :class:`DaemonNotRunning` when nothing answers on the socket.
    """

    def __init__(self, socket: str | None = None, *, namespace: Namespace | None = None,
                 client_name: str = "kvstored-python", timeout_s: float = 30.0,
                 cache_salt: str | None = None) -> None:
        self.socket = socket or discover_socket_path()
        self._timeout = timeout_s
        self._client_name = client_name
        self._cache_salt = cache_salt
        target = _target(self.socket)
        self._channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)])
        self._stub = pb_grpc.KVStoreStub(self._channel)
        try:
            self._hello = self._stub.Hello(pb.HelloRequest(), timeout=min(timeout_s, 5.0), wait_for_ready=False)
        except grpc.RpcError as exc:
            self._channel.close()
            # grpc tells why it could not connect in its message alone: the socket itself says
            # (connect's errno), and only a socket can be refused for want of permission
            if exc.code() == grpc.StatusCode.UNAVAILABLE and target.startswith("unix:") \
                    and isinstance(_connect_error(target), PermissionError):
                raise DaemonNotRunning(
                    f"permission denied on {self.socket}: a daemon may well be running, but this user "
                    "may not open its socket (the systemd unit's socket is mode 0660, group kvstored: "
                    "add this user to that group)") from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and _connect_error(target) is None:
                # a daemon binds its socket before it opens its tiers (pre-faulting the arena,
                # restoring the SSD index: minutes for millions of blocks), and serves after
                raise DaemonNotRunning(
                    f"kvstored on {self.socket} accepts connections but did not answer within "
                    f"{min(timeout_s, 5.0):g} s: it is still starting (opening its tiers or restoring its SSD "
                    "index: `systemctl status kvstored` or its log says which), or it is hung") from None
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    and reason_of(exc) is None:
                raise DaemonNotRunning(
                    f"no kvstored daemon answers on {self.socket}. Start one with `kvstored` "
                    "(or `systemctl start kvstored`), or point KVSTORED_SOCKET, Client(socket=...) or "
                    "`kvctl --socket` at a running one.") from None
            raise from_rpc_error(exc, f"kvstored on {self.socket}", timeout_s) from None
        self.daemon_version = self._hello.version
        # whether the daemon takes packed keys: renewed with each session (a restart may bring
        # another version), see _open_session
        self._packed_keys = self._hello.packed_keys
        self._takes_end_stream = self._hello.end_stream   # renewed with each session, as packed keys
        self._lock = threading.Lock()
        self._closed = False
        self._session_id: str | None = None
        self._session_call: Any = None
        self._session_done = threading.Event()   # the current session's: set, its stream ends
        self._opening: threading.Event | None = None   # set when the thread opening a session is done
        self._arena: np.ndarray | None = None
        self._arena_map: mmap.mmap | None = None
        self._namespace_ids: dict[Namespace, tuple[int, Namespace]] = {}
        self._releases_lock = threading.Lock()
        self._pending_releases: list[grpc.Future] = []
        self._hashers: dict[tuple[int, str, str], ChainHasher] = {}
        self._stream_ids = itertools.count(1)   # next() is atomic under the GIL: threads may share it
        self.namespace = namespace or Namespace()

    # -- plumbing -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"this client of {self.socket} is closed; make a new one")

    def _closed_during_call(self) -> ClientClosed:
        return ClientClosed(f"this client of {self.socket} was closed during the call")

    def _no_session(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"kvstored on {self.socket} did not open a session within {self._timeout:g} s "
                                "(Client timeout_s)")

    def _error(self, exc: grpc.RpcError) -> KVStoreError:
        """The SDK error for a failed call, naming the daemon where the status alone would not.
        (A call cancelled but not by this client, whose own cancellations end in ClientClosed or
        are the caller's close(), was cancelled by a stopping daemon: DaemonNotRunning.)"""
        if self._closed:
            return self._closed_during_call()
        err = from_rpc_error(exc, f"kvstored on {self.socket}", self._timeout)
        if err.reason == Reason.UNKNOWN_NAMESPACE or (err.reason == Reason.NOT_FOUND and reason_of(exc) is None):
            # a restarted daemon that has not heard of the namespace (calls without a session never
            # see the restart): the next call opens it again. (A daemon older than reasons says
            # NOT_FOUND alone: any of them may be that, and asking for the ids again is cheap.)
            self._namespace_ids.clear()
        return err

    def _call(self, method: Callable[..., T], request: Any) -> T:
        self._check_open()
        try:
            try:
                return method(request, timeout=self._timeout)
            except grpc.RpcError as exc:
                ns_id = getattr(request, "namespace_id", 0)
                known = [ns for ns, entry in list(self._namespace_ids.items()) if entry[0] == ns_id]
                if not (ns_id and known and reason_of(exc) == Reason.UNKNOWN_NAMESPACE):
                    raise
                # The daemon restarted and lost the namespace (none was persisted, or it runs
                # without an SSD tier): open it again (its id is its identity) and retry once; the
                # daemon refused the call before doing anything.
                self._namespace_ids.pop(known[0], None)
                request.namespace_id = self._ns(known[0])[0]
                return method(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        except ValueError:   # grpc's "Cannot invoke RPC on closed channel!"
            if self._closed:
                raise self._closed_during_call() from None
            raise

    def _session(self) -> str:
        """The session id, opening a session first if there is none."""
        return self._session_arena(False)[0]

    def _session_arena(self, arena: bool = True) -> tuple[str, np.ndarray | None]:
        """The session id and (with ``arena``) the arena of the daemon that session belongs to,
        taken together: a block's offset from a call in this session always goes with this
        mapping, even if the daemon restarts meanwhile (the old mapping stays valid, unlinked).

        Opening a session takes at most ``timeout_s`` (DeadlineExceeded); one thread opens it,
        others wait for that (each within its own ``timeout_s``). A session's first event names
        the daemon's arena: after a restart the new arena is mapped and namespace ids are asked
        for again."""
        deadline = time.monotonic() + self._timeout
        while True:
            with self._lock:
                self._check_open()
                if self._session_id is not None:
                    return self._session_id, self._arena_view() if arena else None
                opening = self._opening
                if opening is None:
                    opening = self._opening = threading.Event()
                    mine = True
                else:
                    mine = False
            if mine:
                try:
                    self._open_session(max(0.0, deadline - time.monotonic()))
                finally:
                    with self._lock:
                        self._opening = None
                    opening.set()
                continue   # take the session (and arena) under the lock
            if not opening.wait(max(0.0, deadline - time.monotonic())) or time.monotonic() >= deadline:
                raise self._no_session()

    def _open_session(self, timeout: float) -> None:
        """Open a session (the caller is the only thread doing so); raise on failure."""
        done = threading.Event()
        hello = pb.SessionRequest(client_name=self._client_name, pid=os.getpid())

        def requests() -> Iterator[pb.SessionRequest]:
            yield hello
            done.wait()  # keep the stream open for the session's lifetime

        try:
            call = self._stub.Session(requests())
        except ValueError:
            self._check_open()
            raise
        first: queue.Queue[Any] = queue.Queue(maxsize=1)
        with self._lock:
            self._session_call = call   # before the watcher can see the session end
            self._session_done = done
        threading.Thread(target=self._watch_session, args=(call, done, first), daemon=True,
                         name="kvstored-session").start()
        try:
            opened = first.get(timeout=timeout)
        except queue.Empty:
            opened = self._no_session()
        except BaseException:
            # interrupted (KeyboardInterrupt): the stream would stay open, a session of the daemon
            # (and two threads here) that nothing uses nor ends until the client closes
            with self._lock:
                if self._session_call is call:
                    self._session_call = None
            call.cancel()
            done.set()
            raise
        with self._lock:
            if self._closed:
                # closed by another thread meanwhile (its close cancelled the session stream): not
                # the daemon's doing
                opened = self._closed_during_call()
            elif not isinstance(opened, BaseException) and self._session_call is not call:
                opened = DaemonNotRunning(f"kvstored on {self.socket} ended the session at once")
            if isinstance(opened, BaseException):
                if self._session_call is call:
                    self._session_call = None
                call.cancel()
                done.set()
                raise opened
            if opened.arena_path and \
                    (opened.arena_path, opened.arena_bytes) != (self._hello.arena_path, self._hello.arena_bytes):
                # Another daemon than the one the arena mapping and namespace ids came from (a
                # restart): views other threads still hold keep the old mapping alive. (A daemon
                # older than this field sends no arena_path: the Hello's stands.)
                hello_now = pb.HelloResponse()
                hello_now.CopyFrom(self._hello)
                hello_now.arena_path, hello_now.arena_bytes = opened.arena_path, opened.arena_bytes
                self._hello = hello_now
                self._arena = None
                self._arena_map = None
                self._namespace_ids.clear()
            self._packed_keys = opened.packed_keys
            self._takes_end_stream = opened.end_stream
            self._session_id = opened.session_id

    def _watch_session(self, call: Any, done: threading.Event, first: queue.Queue[Any]) -> None:
        try:
            first.put(next(call))
        except grpc.RpcError as exc:
            first.put(self._error(exc))
            return
        except StopIteration:
            first.put(DaemonNotRunning(f"kvstored on {self.socket} closed the session at once"))
            return
        try:
            for event in call:
                if event.closing:
                    break
        except grpc.RpcError:
            pass
        done.set()
        with self._lock:
            if self._session_call is call:
                # daemon restarted or stopped: the next call opens a new session, and namespace
                # ids are asked for again (cheap; a restarted daemon may know other namespaces)
                self._session_id = None
                self._session_call = None
                self._namespace_ids.clear()

    def _arena_view(self) -> np.ndarray:
        """The current daemon's arena (mapped on first use); DaemonNotRunning when it is gone."""
        if self._arena is None:
            try:
                fd = os.open(self._hello.arena_path, os.O_RDWR)
            except OSError as exc:
                raise DaemonNotRunning(f"the arena of kvstored on {self.socket} is gone ({exc.strerror}); "
                                       "the daemon restarted or stopped") from None
            try:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._arena_map = mmap.mmap(fd, self._hello.arena_bytes, flags=flags)
            finally:
                os.close(fd)
            self._arena = np.frombuffer(self._arena_map, dtype=np.uint8)
        return self._arena

    def _ns(self, namespace: Namespace | None) -> tuple[int, Namespace]:
        self._check_open()
        ns = namespace or self.namespace
        entry = self._namespace_ids.get(ns)
        if entry is None or entry[1].block_bytes == 0:
            try:
                ns.validate()
                spec = namespace_to_pb(ns)
            except (ValueError, TypeError) as exc:
                raise InvalidArgument(f"bad namespace: {exc}") from None
            resp = self._call(self._stub.OpenNamespace, pb.OpenNamespaceRequest(spec=spec))
            entry = (resp.namespace_id, namespace_from_pb(resp.spec))
            self._namespace_ids[ns] = entry
        return entry

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
        hasher_key = (spec.block_size, spec.hash_seed, spec.hash_algo)
        hasher = self._hashers.get(hasher_key)
        if hasher is None:
            try:
                hasher = self._hashers[hasher_key] = ChainHasher(*hasher_key)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        try:
            chain = hasher.hashes(_token_array(tokens), cache_salt=salt or None)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self._put_keys(into, b"".join(chain), chain)
        return len(chain)

    def _put_keys(self, into: pb.BlockKeys, packed: bytes, chain: Sequence[bytes]) -> None:
        if self._packed_keys:
            into.packed_hashes = packed
        else:   # a daemon from before packed keys would see none
            into.hashes.extend(bytes(h) for h in chain)

    def _settle_releases(self) -> None:
        """Wait for the releases sent in the background, so a call that acts on what is leased
        (evict, migrate) sees them done: the daemon may serve calls out of order."""
        with self._releases_lock:
            pending, self._pending_releases = self._pending_releases, []
        for fut in pending:
            try:
                fut.result(timeout=self._timeout)
            except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass   # the lease expires by itself; nothing the caller can do about it

    def _end_stream(self, session_id: str, stream_id: int) -> None:
        """Return once the daemon's stream ``stream_id`` is over: no copy into the engine's
        buffers runs then or starts later. Quietly when the daemon or the session is gone (its
        streams ended with it)."""
        with contextlib.suppress(KVStoreError):
            self._call(self._stub.EndStream, pb.EndStreamRequest(session_id=session_id, stream_id=stream_id))

    def _release_later(self, session_id: str, lease_id: int) -> None:
        """Send the release of a lease of session ``session_id`` without waiting for it. Never
        raises: a lease that cannot be released (the session or the client is gone) expires."""
        if session_id != self._session_id:
            return   # its session ended: the daemon released the lease with it
        try:
            # The future must stay referenced until it is done: grpc cancels a collected one.
            fut = self._stub.Release.future(pb.ReleaseRequest(session_id=session_id, lease_id=lease_id),
                                            timeout=self._timeout)
        except ValueError:   # the channel is closed
            return
        with self._releases_lock:
            self._pending_releases = [f for f in self._pending_releases if not f.done()]
            self._pending_releases.append(fut)

    def _release_now(self, session_id: str, lease_id: int) -> None:
        """Give a lease back on a failure path; the original error is what the caller sees."""
        try:
            self._stub.Release(pb.ReleaseRequest(session_id=session_id, lease_id=lease_id), timeout=self._timeout)
        except (grpc.RpcError, ValueError):
            pass   # it expires by itself

    # -- reuse --------------------------------------------------------------------------------
    def lookup(self, tokens: Any = None, *, hashes: Sequence[bytes] | None = None,
               namespace: Namespace | None = None, cache_salt: str | None = None,
               peers: bool = False) -> LookupResult:
        """How many leading tokens of a prompt are cached, and on which tiers. Nothing is leased
        or stored; blocks of the prefix found only on SSD start moving to DRAM in the background
        (as ``prefetch`` does), and the lookup counts as a use of the prefix for eviction.

        With ``peers`` the daemon also asks its peers for the blocks after its own prefix:
        ``per_peer`` says how many each holds, and the best one's run counts as tier "peer"."""
        ns_id, spec = self._ns(namespace)
        request = pb.LookupRequest(namespace_id=ns_id, peers=peers)
        self._keys(request.keys, spec, tokens, hashes, cache_salt)
        resp = self._call(self._stub.Lookup, request)
        return LookupResult(resp.hit_blocks * spec.block_size, resp.hit_blocks, _per_tier(resp.tiers),
                            {h.node_id: h.blocks for h in resp.peer_hits})

    def save(self, tokens: Any, kv: Any, *, hashes: Sequence[bytes] | None = None,
             namespace: Namespace | None = None, cache_salt: str | None = None,
             push_to: str = "") -> SaveResult:
        """Store a prompt's KV: ``kv`` has one row per whole block (numpy array or CPU tensor).

        Blocks already cached are skipped; when the DRAM tier cannot make room, a shorter prefix
        is stored (``stored`` says how much). One reserve and one seal call per batch. With
        ``push_to`` (a peer node id) the daemon also pushes the chain to that node in the
        background, in order, skipping what it holds.
        """
        # first: a new session after a restart renews the namespace ids; and the arena goes with it
        session, arena = self._session_arena()
        assert arena is not None, "an arena comes with the session when asked for"
        ns_id, spec = self._ns(namespace)
        reserve = pb.ReserveRequest(session_id=session, namespace_id=ns_id)
        n_blocks = self._keys(reserve.keys, spec, tokens, hashes, cache_salt)
        rows = _rows(kv)
        if rows.shape[0] < n_blocks:
            raise InvalidArgument(f"kv has {rows.shape[0]} rows for {n_blocks} blocks")
        if n_blocks == 0:
            return SaveResult(0, 0, spec.block_size)
        block_bytes = reserve.block_bytes = rows.shape[1]
        resp = self._call(self._stub.Reserve, reserve)
        if spec.block_bytes == 0:
            self._namespace_ids.pop(namespace or self.namespace, None)  # learn the fixed size
        first = resp.present_blocks
        try:
            for i, offset in enumerate(resp.offsets):
                arena[offset: offset + block_bytes] = rows[first + i]
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

    def load(self, tokens: Any = None, *, hashes: Sequence[bytes] | None = None, out: Any = None,
             dtype: Any = None, namespace: Namespace | None = None,
             cache_salt: str | None = None) -> LoadResult:
        """Read the KV of the longest cached prefix, one row per block.

        With ``out`` (an array or tensor with a row per block, e.g. reused between calls) rows
        are copied into it and ``data`` is a view of its first ``blocks`` rows; otherwise a new
        uint8 array (or ``dtype``) is returned. Raises LeaseExpired if the read outlived its lease;
        bad ``out``/``dtype`` raise InvalidArgument (nothing stays leased).
        """
        # first: a new session after a restart renews the namespace ids; and the arena goes with it
        session, arena = self._session_arena()
        assert arena is not None, "an arena comes with the session when asked for"
        ns_id, spec = self._ns(namespace)
        lookup = pb.LookupRequest(namespace_id=ns_id, lease=True, session_id=session)
        self._keys(lookup.keys, spec, tokens, hashes, cache_salt)
        out_rows = None if out is None else _writable_rows(out)
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
        started = time.monotonic()
        resp = self._call(self._stub.Lookup, lookup)
        hit = resp.hit_blocks
        if not hit:   # rows as wide as the namespace's blocks (0 while its size is unknown)
            if out is not None:
                return LoadResult(0, 0, out[:0])
            empty = np.empty((0, resp.block_bytes), np.uint8)
            return LoadResult(0, 0, empty if row_type is None or resp.block_bytes % row_type.itemsize
                              else empty.view(row_type))
        block_bytes = resp.block_bytes
        try:
            if out_rows is not None:
                rows = out_rows
                if rows.shape[0] < hit or rows.shape[1] != block_bytes:
                    raise InvalidArgument(f"out has rows of {rows.shape[1]} bytes x {rows.shape[0]}; "
                                          f"need {hit} rows of {block_bytes} bytes")
                data = out[:hit]
            else:
                rows = np.empty((hit, block_bytes), dtype=np.uint8)
                if row_type is not None and block_bytes % row_type.itemsize:
                    raise InvalidArgument(f"a block of {block_bytes} bytes is not a whole number of "
                                          f"{row_type} items")
                data = rows if row_type is None else rows.view(row_type)
            for i, offset in enumerate(resp.offsets):
                rows[i] = arena[offset: offset + block_bytes]
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

    # -- engine buffers -------------------------------------------------------------------------
    def register_buffers(self, tensors: Sequence[Any], block_dim: int | Sequence[int] = 0, *,
                         namespace: Namespace | None = None) -> Buffers:
        """Register an engine's paged KV tensors (allocated with ``kvstored.shm.empty``).

        A block's payload is each tensor indexed at the block along ``block_dim``, in order. The
        daemon maps them and copies blocks itself in ``save_blocks``/``load_blocks``.
        """
        if isinstance(tensors, (np.ndarray, shm.SharedTensor)) or hasattr(tensors, "data_ptr") \
                or hasattr(tensors, "__cuda_array_interface__"):
            # iterated, its slices along dimension 0 (vLLM's K and V halves) would each be
            # registered as a tensor of its own: a layout of other blocks than the engine's
            raise InvalidArgument("tensors must be a list of tensors (one buffer of all layers too: "
                                  f"[buffer]), got a single {type(tensors).__name__}")
        try:
            tensors = list(tensors)
            dims = [block_dim] * len(tensors) if isinstance(block_dim, (int, np.integer)) else list(block_dim)
        except TypeError as exc:
            raise InvalidArgument(f"tensors must be a list of tensors and block_dim an int or one per tensor: "
                                  f"{exc}") from None
        if len(dims) != len(tensors):
            raise InvalidArgument("one block_dim per tensor")
        for i, dim in enumerate(dims):
            if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
                raise InvalidArgument(f"block_dim of tensors[{i}] must be an int, got {dim!r}")
        dims = [int(dim) for dim in dims]
        descs, layouts = [], []
        for i, (t, dim) in enumerate(zip(tensors, dims)):
            try:
                if cuda_export.is_cuda(t):
                    dev = cuda_export.export(t)
                    layout = TensorLayout(*cuda_export.layout_info(t), dim)
                    layout.validate()
                    desc = pb.TensorDesc(offset=dev.offset, cuda_ipc_handle=dev.handle,
                                         device_uuid=dev.device_uuid)
                else:
                    place = shm.describe(t, dim)
                    layout = place.layout
                    desc = pb.TensorDesc(shm_name=place.shm_name, offset=place.offset)
            except (ValueError, TypeError) as exc:
                raise InvalidArgument(f"tensors[{i}]: {exc}") from None
            desc.shape.extend(layout.shape)
            desc.strides.extend(layout.strides)
            desc.dtype, desc.block_dim = layout.dtype, dim
            descs.append(desc)
            layouts.append(layout)
        # The layout signature enters the namespace: blocks saved under one layout are never
        # loaded into another.
        ns = namespace or self.namespace
        signature = layout_signature(layouts)
        if ns.layout and ns.layout != signature:
            raise InvalidArgument(f"buffers have layout {signature!r} but the namespace says {ns.layout!r}")
        ns = dataclasses.replace(ns, layout=signature)
        session = self._session()
        resp = self._register(session, ns, descs)
        return Buffers(resp.num_blocks, resp.block_bytes, resp.layout, ns, len(descs),
                       _Registration(self, tuple(descs), (session, resp.buffers_id)))

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

    def _registration_of(self, buffers: Buffers) -> _Registration:
        reg = buffers._registration
        if reg.client is not self:
            raise InvalidArgument("these buffers were registered by another client")
        return reg

    @contextlib.contextmanager
    def _holding(self, reg: _Registration) -> Iterator[None]:
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
        _set_block_ids(request, _block_id_sequence(block_ids), buffers, self._packed_keys)
        resp = self._call(self._stub.SaveBlocks, request)
        return SaveResult(resp.present_blocks, resp.stored_blocks, spec.block_size)

    def load_blocks(self, buffers: Buffers, block_ids: Sequence[int], tokens: Any = None, *,
                    hashes: Sequence[bytes] | None = None, cache_salt: str | None = None,
                    wait: bool = True) -> Any:
        """Copy the cached prefix of the prompt into blocks ``block_ids``.

        Returns a LookupResult of what was loaded; with ``wait=False`` returns a
        :class:`LoadHandle` at once, whose ``wait_layer(i)`` returns when registered tensor ``i``
        is in place (compute layer i while later layers arrive) and ``wait()`` when all are.
        """
        session = self._session()
        ns_id, spec = self._ns(buffers.namespace)
        request = pb.LoadBlocksRequest(session_id=session, namespace_id=ns_id,
                                       buffers_id=self._buffers_id(buffers, session))
        self._keys(request.keys, spec, tokens, hashes, cache_salt)
        _set_block_ids(request, _block_id_sequence(block_ids), buffers, self._packed_keys)
        if not wait:
            try:
                call = self._stub.LoadBlocksStream(request, timeout=self._timeout)
            except ValueError:   # the channel was closed meanwhile
                self._check_open()
                raise
            return LoadHandle(call, spec.block_size, buffers.num_tensors, self._error)
        resp = self._call(self._stub.LoadBlocks, request)
        return _loaded(resp, spec.block_size)

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
            block_ids = _block_id_sequence(block_ids)
        if buffers is not None and (block_ids is None or len(block_ids) != n_blocks):
            raise InvalidArgument(f"give one block id per block ({n_blocks}) with buffers")
        if buffers is None and block_ids is not None and len(block_ids):
            # (they were ignored: each block came back as bytes, none went to the engine's buffers)
            raise InvalidArgument("block_ids name blocks of registered buffers: give buffers too")
        _set_block_ids(request, [] if block_ids is None else block_ids, buffers, self._packed_keys)
        started = time.monotonic()
        try:
            call = self._stub.StreamBlocks(request, timeout=self._timeout)
        except ValueError:   # closed channel
            self._check_open()
            raise
        return BlockStream(self, session, call, arena, spec.block_size, spec.block_bytes, started,
                           lambda: self._ns(ns)[1].block_bytes, request.stream_id)

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
            for event in self._stub.StreamBlocks(request, timeout=self._timeout):
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
        for p in self._until_idle(self._stub.Migrate(request, timeout=None), "migration",
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
            "tiers": [{k: (int(v) if k != "name" else v) for k, v in t.items()} for t in out["tiers"]]}

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
        progress = self._until_idle(self._stub.FlushStream(pb.FlushRequest(model=model), timeout=None), "flush",
                                    max(self._timeout, PROGRESS_IDLE_MIN_S))
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

    def close(self) -> None:
        """End the session (the daemon releases its leases and buffers) and the channel. Calls
        afterwards raise ClientClosed; closing again does nothing."""
        if self._closed:
            return
        self._settle_releases()
        with self._lock:
            self._closed = True
            done, call = self._session_done, self._session_call
        done.set()
        if call is not None:
            call.cancel()
        self._channel.close()
        self._arena = None
        if self._arena_map is not None:
            try:
                self._arena_map.close()
            except BufferError:
                pass
            self._arena_map = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _per_tier(tiers: Sequence[int]) -> dict[str, int]:
    return {TIER_NAMES.get(tier, str(tier)): n for tier, n in Counter(tiers).items()}


def _loaded(resp: pb.LoadBlocksResponse, block_size: int) -> LookupResult:
    return LookupResult(resp.loaded_blocks * block_size, resp.loaded_blocks, _per_tier(resp.tiers))


class LoadHandle:
    """A load in progress (``load_blocks(wait=False)``): the daemon reports each tensor (layer) as
    it completes. Raises the load's error from ``wait``/``wait_layer``/``result``, and
    DeadlineExceeded (a TimeoutError) when a wait's ``timeout`` passes first."""

    def __init__(self, stream: Any, block_size: int, num_tensors: int = 0,
                 error: Callable[[grpc.RpcError], KVStoreError] = from_rpc_error) -> None:
        self._stream = stream
        self._block_size = block_size
        self._num_tensors = num_tensors
        self._to_error = error
        self._cond = threading.Condition()
        self._layers: set[int] = set()
        self._result: LookupResult | None = None
        self._done = False
        self._error: KVStoreError | None = None
        threading.Thread(target=self._consume, daemon=True, name="kvstored-load").start()

    def _consume(self) -> None:
        try:
            for event in self._stream:
                kind = event.WhichOneof("event")
                with self._cond:
                    if kind == "started":
                        self._result = _loaded(event.started, self._block_size)
                    elif kind == "tensor_done":
                        self._layers.add(event.tensor_done)
                    elif kind == "done":
                        self._done = True
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self._error = self._to_error(exc)
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def _wait_for(self, ready: Callable[[], bool], timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self._error is not None or self._done, timeout):
                # a KVStoreError like every SDK failure, and still the TimeoutError it always was
                raise DeadlineExceeded(f"the load is still in progress after {timeout:g} s (the wait's timeout)")
            if self._error is not None:
                raise self._error
            if not ready():
                raise KVStoreError("the load ended early")

    def wait_layer(self, index: int, timeout: float | None = None) -> None:
        """Block until registered tensor ``index`` holds every loaded block; InvalidArgument for
        an index that is not one of the registered tensors."""
        if self._num_tensors and not 0 <= index < self._num_tensors:
            raise InvalidArgument(f"tensor {index} is not one of the {self._num_tensors} registered tensors")
        self._wait_for(lambda: index in self._layers, timeout)

    def wait(self, timeout: float | None = None) -> LookupResult:
        """Block until every copy is done; returns what was loaded."""
        self._wait_for(lambda: self._done, timeout)
        return self.result()

    def result(self) -> LookupResult:
        """What is being loaded (known as soon as the daemon started copying)."""
        self._wait_for(lambda: self._result is not None, None)
        assert self._result is not None, "no result after waiting for it"
        return self._result


class BlockStream:
    """A streamed load (``Client.stream``): iterate for :class:`BlockArrival` in token order;
    ``outcome`` afterwards. Leaving the loop early (or ``close``) cancels the rest; into engine
    buffers it returns once the daemon has stopped (no copy into them runs or starts after), so
    the engine may reuse the blocks that did not arrive at once."""

    def __init__(self, client: Client, session_id: str, call: Any, arena: np.ndarray | None, block_size: int,
                 block_bytes: int, started: float, learn_block_bytes: Callable[[], int] | None = None,
                 stream_id: int = 0) -> None:
        self._client = client
        self._started = started   # monotonic, before the call: the lease's clock starts later
        self._session_id = session_id
        self._call = call
        self._arena = arena
        self._block_size = block_size
        self._block_bytes = block_bytes
        # a namespace whose block size was not known when the stream started (another client's
        # first save, or a peer's push, fixed it since): asked again when a block arrives
        self._learn_block_bytes = learn_block_bytes
        self._keep_data = True
        self._stream_id = stream_id   # into buffers: EndStream's id
        self._cancelled = False   # by close()
        self.outcome: StreamOutcome | None = None

    def __iter__(self) -> Iterator[BlockArrival]:
        """Arrivals in token order. In arena mode (no buffers) each block is copied out as the
        loop reaches it (the rest of its event at once when half the lease has passed), under the
        stream's lease; when the copies may have outlived that lease (an engine slower than
        ``leases.ttl_s``), the loop ends with LeaseExpired after the last arrival, as ``load``
        does, instead of leaving bytes that may be another block's."""
        lease_id = 0
        ttl_s = self._client._hello.lease_ttl_ms / 1000
        try:
            for event in self._call:
                lease_id = lease_id or event.lease_id   # told first, so leaving early can release it
                blocks = event.blocks
                if blocks and not self._block_bytes and self._arena is not None and self._keep_data \
                        and self._learn_block_bytes is not None:
                    # else each arrival would carry 0 bytes of its block
                    self._block_bytes = self._learn_block_bytes()
                copied: dict[int, Any] = {}
                for k, b in enumerate(blocks):
                    data = None
                    if self._arena is not None and self._keep_data:
                        if k not in copied and time.monotonic() - self._started >= ttl_s / 2:
                            # The loop dawdles: copy the rest of this event while the lease (ttl
                            # from the lookup, after the call started) surely still holds them.
                            # Before this point every copy is under the lease: block 0 goes out
                            # without waiting for (and holding) the whole event's bytes.
                            for j in range(k, len(blocks)):
                                o = blocks[j].offset
                                copied[j] = self._arena[o: o + self._block_bytes].copy()
                        data = copied.pop(k, None)
                        if data is None:
                            data = self._arena[b.offset: b.offset + self._block_bytes].copy()
                    yield BlockArrival(b.index, TIER_NAMES.get(b.tier, str(b.tier)), b.peer, data)
                if event.HasField("end"):
                    e = event.end
                    lease_id = e.lease_id   # 0 when nothing stayed leased
                    ttl_s = e.lease_ttl_ms / 1000 or ttl_s
                    self.outcome = StreamOutcome(e.blocks, e.requested, e.blocks * self._block_size, e.stop, e.detail)
                    break
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self.outcome is None and self._cancelled:
                return   # close(): the caller stopped the stream
            # Cancelled by anyone else (the client closed, the daemon stopping) is an error, not a
            # quiet end with no outcome that looks like the caller's own close.
            raise self._client._error(exc) from None
        finally:
            if self.outcome is None:
                self._call.cancel()   # left early: the daemon drops the rest
                # the caller's doing, as close(): a later loop or wait() over this stream ends as
                # closed, not with the CANCELLED of a stopping daemon (DaemonNotRunning)
                self._cancelled = True
                if self._stream_id:
                    self._client._end_stream(self._session_id, self._stream_id)
            if lease_id and (self.outcome is None or self._arena is None or not self._keep_data
                             or time.monotonic() - self._started < ttl_s / 2):
                # Also when left early: the daemon may have finished and handed the lease to an
                # end this loop never read (releasing one it already dropped is a no-op). Well
                # inside the lease (the daemon holds it for the stream and ttl after its end),
                # every copy was pinned: the release need not be waited for.
                self._client._release_later(self._session_id, lease_id)
                lease_id = 0
        if lease_id:
            try:
                self._client._call(self._client._stub.Release,
                                   pb.ReleaseRequest(session_id=self._session_id, lease_id=lease_id))
            except LeaseExpired as exc:
                raise LeaseExpired(f"the stream's blocks were read after its lease ended: {exc}") from None
            except KVStoreError:
                pass   # not an expiry (the daemon went away after the end): the lease is gone with it

    def close(self) -> None:
        """Stop the stream before its end; its lease (if the loop saw it) is released when the
        loop exits. Without a loop, the daemon drops the lease when the call is cancelled or,
        at the latest, when it expires. Into engine buffers, returns once the daemon copies into
        them no more."""
        self._cancelled = True
        self._call.cancel()
        if self._stream_id and self.outcome is None:
            self._client._end_stream(self._session_id, self._stream_id)

    def wait(self) -> StreamOutcome:
        """Consume the stream without keeping the arrivals (nor copying their bytes); the outcome."""
        self._keep_data = False
        for _ in self:
            pass
        if self.outcome is None:   # the loop ends without an outcome only when the call was cancelled
            raise KVStoreError("the stream was closed before its end")
        return self.outcome


def _connect_error(target: str) -> OSError | None:
    """Why a plain connect to the gRPC ``target`` (``unix:PATH`` or ``dns:HOST:PORT``, as
    :func:`_target` makes them) fails, given at most a second; None when something listens."""
    import socket as sockets

    try:
        if target.startswith("unix:"):
            with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(target.removeprefix("unix:"))
            return None
        if target.startswith("dns:"):
            host, _, port = target.removeprefix("dns:").rpartition(":")
            with sockets.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return None
    except OSError as exc:
        return exc
    except ValueError as exc:   # not a port number
        return OSError(str(exc))
    return OSError(f"cannot probe {target}")


def _target(socket: str) -> str:
    """The gRPC target for ``socket``: a Unix socket path, ``host:port`` (the daemon's
    ``server.tcp`` listener), or an explicit gRPC target (``unix:``, ``ipv4:``, ``ipv6:``, ``dns:``)."""
    if socket.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return socket
    if "/" not in socket and re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[\w.-]+):\d{1,5}", socket):
        return f"dns:{socket}"
    return f"unix:{socket}"


def _token_array(tokens: Any) -> np.ndarray:
    if hasattr(tokens, "detach"):  # torch tensor
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens)


def _rows(kv: Any) -> np.ndarray:
    """A (blocks, bytes) uint8 view of ``kv`` without copying; InvalidArgument if it is not one."""
    if hasattr(kv, "detach"):  # torch tensor: view its bytes through numpy
        import torch

        if kv.device.type != "cpu":
            raise InvalidArgument("save/load take CPU tensors; use register_buffers for device memory")
        if kv.dim() < 2:
            raise InvalidArgument(f"kv must have one row per block (at least 2 dimensions); got shape "
                                  f"{tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise InvalidArgument("kv tensor must be contiguous")
        # the row width from the shape, not -1: a reshape cannot infer it for 0 rows
        arr = kv.detach().reshape(kv.shape[0], math.prod(kv.shape[1:])).view(torch.uint8).numpy()
    else:
        arr = np.asarray(kv)
        if arr.ndim < 2:
            # a flat array would be taken as one-byte blocks, and fix the namespace's size at that
            raise InvalidArgument(f"kv must have one row per block (at least 2 dimensions); got shape {arr.shape}")
        if arr.dtype.hasobject:
            raise InvalidArgument(f"kv must hold numbers, not {arr.dtype} objects")
        if not arr.flags.c_contiguous:
            raise InvalidArgument("kv array must be C-contiguous")
        arr = arr.reshape(arr.shape[0], math.prod(arr.shape[1:])).view(np.uint8)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise InvalidArgument("kv must have one non-empty row per block")
    return arr


def _writable_rows(out: Any) -> np.ndarray:
    """``out`` as (blocks, bytes) uint8 rows that loads may write into."""
    rows = _rows(out)
    if not rows.flags.writeable:
        raise InvalidArgument("out is read-only")
    return rows


def _block_id_sequence(block_ids: Any) -> Any:
    """``block_ids`` as :func:`_set_block_ids` (and ``len``) take them: a torch tensor as numpy, any
    other iterable of ids as a list (an iterator would be used up before a bad id could be
    named). InvalidArgument when it is not a one-dimensional sequence."""
    if hasattr(block_ids, "detach"):   # torch tensor
        block_ids = block_ids.detach().cpu().numpy()
    if isinstance(block_ids, np.ndarray):
        if block_ids.ndim != 1:
            raise InvalidArgument(f"block_ids must be one-dimensional, got shape {block_ids.shape}")
        return block_ids
    if isinstance(block_ids, (bytes, bytearray, str)):
        raise InvalidArgument("block_ids must be a sequence of ints, one per block")
    if isinstance(block_ids, (list, tuple, range, array.array)):
        return block_ids
    try:
        return list(block_ids)
    except TypeError:
        raise InvalidArgument(f"block_ids must be a sequence of ints, one per block; got "
                              f"{type(block_ids).__name__}") from None


def _set_block_ids(request: Any, block_ids: Sequence[int], buffers: Buffers | None, packed: bool = True) -> None:
    """Put ``block_ids`` (ints: numpy and torch integers too, and bools as the ints they are)
    into ``request.packed_block_ids``, little-endian uint32s: one field, not 8,192 varints for a
    128k-token prompt, on the way to the first block (``packed`` False: ``block_ids``, for a daemon
    from before). For an id that is not a uint32, InvalidArgument names it. Ids beyond the buffers
    are the daemon's to refuse."""
    if isinstance(block_ids, (bytes, bytearray, str)):
        raise InvalidArgument("block_ids must be a sequence of ints, one per block")
    if packed and isinstance(block_ids, np.ndarray) and block_ids.dtype.kind in "iu" and block_ids.ndim == 1 and (
            not block_ids.size or (block_ids.min() >= 0 and block_ids.max() < 1 << 32)):
        request.packed_block_ids = block_ids.astype("<u4").tobytes()
        return
    try:
        ids = array.array("I", block_ids)
    except (TypeError, ValueError, OverflowError):
        limit = buffers.num_blocks if buffers is not None else 1 << 32
        for i, b in enumerate(block_ids):
            if not isinstance(b, (int, np.integer)) or not 0 <= b < limit:
                raise InvalidArgument(f"block_ids[{i}] = {b!r} is not a block of the buffers "
                                      f"(0..{limit - 1})") from None
        raise InvalidArgument("block_ids must be a sequence of ints, one per block") from None
    if not packed:
        request.block_ids.extend(ids)
        return
    assert ids.itemsize == 4, "array's 'I' is 32 bits on every platform numpy supports"
    if sys.byteorder == "big":
        ids.byteswap()
    request.packed_block_ids = ids.tobytes()
