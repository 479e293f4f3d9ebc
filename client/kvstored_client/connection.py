"""A connection to a kvstored daemon: the channel, the session, and calls that become SDK errors.

One connection holds one gRPC channel to the daemon and, once needed, one session (a stream
whose end releases everything the client held) and a mapping of the daemon's DRAM arena; it
follows a daemon restart (a new session, the new arena, namespace ids asked for again) and
retries once a call naming a namespace the daemon lost. :class:`~kvstored_client.client.Client`
builds its calls on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Self, TypeVar, cast

import grpc
import numpy as np

from kvstored_client.contract.errors import DaemonNotRunning, DeadlineExceeded, InvalidArgument, KVStoreError, Reason
from kvstored_client.contract.frames import METHODS, one_way_frame
from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.paths import discover_socket_path, socket_path_problem
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc
from kvstored_client.contract.wire import namespace_from_pb, namespace_to_pb
from kvstored_client.errors import ClientClosed, from_rpc_error, reason_of
from kvstored_client.fast_path import FastChannel, Unreachable
from kvstored_client.presence import PresenceReader, TableUnusable
from kvstored_client.spares import SpareSlots
from kvstored_client.write_behind import WriteBehind

MAX_MESSAGE_BYTES = 64 << 20
CLOSE_WAITS_FOR_COPIES_S = 10.0   # close() waits this long at most for rows being copied into the arena
# gRPC backs off reconnecting after a failed connect (1 s, growing 1.6x up to 120 s): calls made
# while the daemon restarts stretched it, and the same client kept failing with DaemonNotRunning for
# as long again after the daemon was back. The daemon is local: retrying its socket is cheap.
RECONNECT_BACKOFF_MS = 100
# A fast socket that cannot be opened is tried again after this long (calls take gRPC meanwhile).
FAST_RETRY_S = 1.0
FAST_PATH_ENV = "KVSTORED_FAST_PATH"   # "0": gRPC for every call (tests, debugging)
PRESENCE_ENV = "KVSTORED_PRESENCE_TABLE"   # "0": lookups take the call, never the table (benchmarks, debugging)
_OFF = ("0", "false", "no", "off")
MAX_RECONNECT_BACKOFF_MS = 1000
T = TypeVar("T")


class Connection:
    """The daemon at ``socket`` (the default one when None), answering within ``timeout_s``;
    DaemonNotRunning when nothing answers there. ``namespace``: the one calls use by default."""

    def __init__(self, socket: str | None, namespace: Namespace | None, client_name: str, timeout_s: float,
                 fast_path: bool | None = None) -> None:
        self.socket = socket or discover_socket_path()
        self._timeout = timeout_s
        self._client_name = client_name
        target = _target(self.socket)
        if target.startswith("unix:") and (problem := socket_path_problem(target.removeprefix("unix:"))):
            raise InvalidArgument(problem)
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
        self._writers = 0   # threads copying rows into the arena (close waits for them)
        self._writers_done = threading.Condition(self._lock)
        self._session_id: str | None = None
        self._session_call: Any = None
        self._session_done = threading.Event()   # the current session's: set, its stream ends
        self._opening: threading.Event | None = None   # set when the thread opening a session is done
        self._arena: np.ndarray | None = None
        self._arena_map: mmap.mmap | None = None
        self._arena_path = ""   # the file self._arena maps
        self._namespace_ids: dict[Namespace, tuple[int, Namespace]] = {}
        self._spares = SpareSlots()   # the session's spare slots, for saves in one call (Commit)
        self._releases_lock = threading.Lock()
        self._pending_releases: list[grpc.Future] = []
        self.namespace = namespace or Namespace()
        # The fast path for the hot calls, when the daemon offers one and is on this host (a
        # Unix socket); off with fast_path=False or KVSTORED_FAST_PATH=0.
        if fast_path is None:
            fast_path = os.environ.get(FAST_PATH_ENV, "1") not in _OFF
        self._fast: FastChannel | None = None
        self._fast_retry_at = 0.0
        self._fast_routes = {id(getattr(self._stub, name)): (name, response)
                             for name, _, response in METHODS.values()}
        self._write_behind: WriteBehind | None = None   # saves sent without their answer (fast path only)
        if fast_path and self._hello.fast_socket and target.startswith("unix:"):
            self._fast = FastChannel(self._hello.fast_socket)
            self._write_behind = WriteBehind(self._fast, self._spares)
            try:
                self._fast.open()
            except Unreachable:
                self._fast_retry_at = time.monotonic() + FAST_RETRY_S
        # Lookups answered from the daemon's presence table (see presence_reader), when it
        # publishes one and the fast path is on (the lookups it answers go there one-way).
        self._presence: PresenceReader | None = None
        self._presence_retry_at = 0.0
        self._presence_on = self._fast is not None and os.environ.get(PRESENCE_ENV, "1") not in _OFF
        if self._presence_on:
            self._open_presence(self._hello)

    @property
    def lookup_transport(self) -> str:
        """How a plain lookup (no lease, no peers) is answered now: "table" (the daemon's
        presence table, in this process), else as :attr:`transport` says."""
        return "table" if self._presence is not None else self.transport

    def _open_presence(self, hello: pb.HelloResponse) -> None:
        if not (hello.presence_table and hello.fast_socket):
            self._presence_retry_at = time.monotonic() + FAST_RETRY_S
            return
        try:
            self._presence = PresenceReader(hello.presence_table, hello.instance_id, hello.fast_socket,
                                            self._timeout, hello.arena_path)
        except TableUnusable:
            self._presence_retry_at = time.monotonic() + FAST_RETRY_S

    def _presence_reader(self) -> PresenceReader | None:
        """The presence table to answer a lookup from, opened again (after asking the daemon
        which one is its own) when a daemon went away; None: take the call."""
        reader = self._presence
        if reader is not None or not self._presence_on or time.monotonic() < self._presence_retry_at:
            return reader
        try:
            hello = self._stub.Hello(pb.HelloRequest(), timeout=min(self._timeout, 5.0), wait_for_ready=False)
        except (grpc.RpcError, ValueError):   # (ValueError: the channel is closed)
            self._presence_retry_at = time.monotonic() + FAST_RETRY_S
            return None
        self._open_presence(hello)
        return self._presence

    def _table_arena(self, reader: PresenceReader) -> np.ndarray | None:
        """This session's arena when it is the one ``reader``'s table names offsets in (the
        same daemon's); None otherwise (a restart between the two: the load takes the lease)."""
        with self._lock:
            if self._session_id is None or self._arena is None or self._arena_path != reader.arena_path \
                    or not reader.arena_path:
                return None
            return self._arena

    def _presence_gone(self, reader: PresenceReader) -> None:
        """``reader``'s daemon is gone: lookups take the call until a table is opened again."""
        reader.close()
        if self._presence is reader:
            self._presence = None

    @property
    def transport(self) -> str:
        """How the hot calls travel now: "frames" (the daemon's fast socket) or "grpc"."""
        if self._fast is None or time.monotonic() < self._fast_retry_at:
            return "grpc"
        return "frames"

    # -- plumbing -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing_arena(self) -> Iterator[None]:
        """Hold off :meth:`close` while rows are copied into slots of this session (a
        reservation's, spares): once the session ends the daemon may give them to other blocks.
        ClientClosed when the client is closed already."""
        with self._lock:
            if self._closed:
                raise ClientClosed(f"this client of {self.socket} is closed; make a new one")
            self._writers += 1
        try:
            yield
        finally:
            with self._lock:
                self._writers -= 1
                if not self._writers:
                    self._writers_done.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"this client of {self.socket} is closed; make a new one")

    def _start_stream(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        """``method(request, timeout=timeout)``: a streaming call started; ClientClosed, not
        grpc's ValueError, when another thread closed this client since the last check."""
        self._saves_answered()   # a stream, too, comes after the saves sent before it
        try:
            return method(request, timeout=timeout)
        except ValueError:   # grpc's "Cannot invoke RPC on closed channel!"
            if self._closed:
                raise self._closed_during_call() from None
            raise

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

    def _invoke(self, method: Callable[..., T], request: Any) -> T:
        """``method`` (a stub's) on ``request``: on the fast path when it carries the method and
        its socket opens, else by gRPC. Raises grpc.RpcError (the fast path's as well)."""
        fast = self._fast
        if fast is not None:
            route = self._fast_routes.get(id(method))
            if route is not None and time.monotonic() >= self._fast_retry_at:
                try:
                    return cast(T, fast.call(route[0], request, route[1], self._timeout))
                except Unreachable:
                    self._fast_retry_at = time.monotonic() + FAST_RETRY_S
        return method(request, timeout=self._timeout)

    def _saves_answered(self) -> None:
        """Read the answers of the saves sent without them (``save(wait=False)``): a call, a
        lookup or a load comes after the saves sent before it, and sees their blocks."""
        if self._write_behind is not None and len(self._write_behind):
            self._write_behind.settle()

    def _call(self, method: Callable[..., T], request: Any) -> T:
        self._check_open()
        self._saves_answered()
        try:
            try:
                return self._invoke(method, request)
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
                return self._invoke(method, request)
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
            self._spares.renew(opened.session_id, opened.spare_bytes)

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
                self._spares.renew("", 0)   # freed by the daemon with the session: not written again
                self._namespace_ids.clear()
                if self._fast is not None:   # its daemon is gone too: the next call connects anew
                    self._fast.reset()
                if self._presence is not None:   # and its table: found again by the next lookup
                    self._presence_gone(self._presence)

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
            self._arena_path = self._hello.arena_path
        return self._arena

    def _ns(self, namespace: Namespace | None, *, learn_block_bytes: bool = False) -> tuple[int, Namespace]:
        """The namespace's id and the daemon's spec of it, opened once per session. The spec's
        ``block_bytes`` is 0 while no block has fixed it; ``learn_block_bytes`` asks the daemon
        again then (the hot calls do not: they learn it from their replies)."""
        self._check_open()
        ns = namespace or self.namespace
        entry = self._namespace_ids.get(ns)
        if entry is None or (learn_block_bytes and entry[1].block_bytes == 0):
            try:
                ns.validate()
                spec = namespace_to_pb(ns)
            except (ValueError, TypeError) as exc:
                raise InvalidArgument(f"bad namespace: {exc}") from None
            resp = self._call(self._stub.OpenNamespace, pb.OpenNamespaceRequest(spec=spec))
            entry = (resp.namespace_id, namespace_from_pb(resp.spec))
            self._namespace_ids[ns] = entry
        return entry

    def _learned_block_bytes(self, namespace: Namespace | None, entry: tuple[int, Namespace],
                             block_bytes: int) -> None:
        """Keep the block size a reply showed for a namespace opened before any block fixed it,
        unless the entry was renewed meanwhile (a new session has other ids)."""
        ns = namespace or self.namespace
        if block_bytes and entry[1].block_bytes == 0:
            with self._lock:   # (a new session clears the ids under it)
                if self._namespace_ids.get(ns) is entry:
                    self._namespace_ids[ns] = (entry[0], dataclasses.replace(entry[1], block_bytes=block_bytes))

    def _settle_releases(self, one_way: bool = True) -> None:
        """Wait for the releases sent in the background, so a call that acts on what is leased
        (evict, migrate) sees them done: the daemon may serve calls out of order. ``one_way``:
        those sent one-way on the fast path too (not at close: the session's end releases all)."""
        fast = self._fast
        if fast is not None and one_way:
            with self._lock:
                session_id = self._session_id
            # a ping each: a release of lease 0, which is never a lease (refused, and ignored)
            try:
                fast.settle("Release", pb.ReleaseRequest(session_id=session_id or "", lease_id=0),
                            pb.ReleaseResponse, self._timeout)
            except grpc.RpcError as exc:   # no answer within timeout_s: the call would get none
                raise self._error(exc) from None
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
        fast = self._fast
        if fast is not None and self.transport == "frames":
            # One-way, on the connection this thread's next call takes (served before that call;
            # calls that act on what is leased settle it first, see _settle_releases): a round
            # trip was a third of a small block's load.
            request = pb.ReleaseRequest(session_id=session_id, lease_id=lease_id)
            try:
                if fast.send_one_way(one_way_frame("Release", request), settle=True):
                    return
            except OSError:
                return   # the daemon is gone, and the lease with its session
            self._release_now(session_id, lease_id)   # no idle connection: a call of its own
            return
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
            self._invoke(self._stub.Release, pb.ReleaseRequest(session_id=session_id, lease_id=lease_id))
        except (grpc.RpcError, ValueError):
            pass   # it expires by itself

    def close(self) -> None:
        """End the session (the daemon releases its leases and buffers) and the channel. Calls
        afterwards raise ClientClosed; closing again does nothing."""
        if self._closed:
            return
        if self._write_behind is not None:
            self._write_behind.settle()
        self._settle_releases(one_way=False)
        with self._lock:
            self._closed = True
            self._spares.renew("", 0)
            # rows being copied into this session's slots land before the session ends
            self._writers_done.wait_for(lambda: not self._writers, timeout=CLOSE_WAITS_FOR_COPIES_S)
            done, call = self._session_done, self._session_call
        done.set()
        if call is not None:
            call.cancel()
        if self._fast is not None:
            self._fast.close()
        if self._presence is not None:
            self._presence_gone(self._presence)
        self._channel.close()
        self._arena = None
        if self._arena_map is not None:
            try:
                self._arena_map.close()
            except BufferError:
                pass
            self._arena_map = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



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
