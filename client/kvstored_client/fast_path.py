"""The SDK's end of the fast path: the hot unary calls in frames on the daemon's fast socket.

Blocking Unix sockets, one call at a time on each: a single-threaded client uses one, threads
calling at once one each (no call waits for another's). A failed call raises
:class:`FrameCallError`, a ``grpc.RpcError`` carrying the daemon's status as gRPC would (code,
message, ``grpc-status-details-bin``), so the one place that maps gRPC failures to SDK errors
(``kvstored_client/errors.py``) maps these too. A call whose deadline passes, or whose
connection breaks, closes its socket (a late answer is never read as another call's).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2

from kvstored_client.contract import frames

M = TypeVar("M", bound=Message)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
DETAILS_KEY = "grpc-status-details-bin"
FIRST_READ = 1 << 16   # an answer's first read: its header and, for most, all of its payload


class FrameCallError(grpc.RpcError):
    """A call on the fast path that failed, as grpc's own call errors present themselves."""

    def __init__(self, code: grpc.StatusCode, message: str, status: bytes = b"") -> None:
        super().__init__(message)
        self._code = code
        self._message = message
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((DETAILS_KEY, self._status),) if self._status else ()


@dataclass(frozen=True, slots=True)
class Sent:
    """A call sent whose answer is still to be read (:meth:`FastChannel.answer`)."""

    sock: socket.socket
    request_id: int
    generation: int
    deadline: float | None


class Unreachable(Exception):
    """The fast socket cannot be opened (gone, refused, not permitted): use gRPC for the call."""


class FastChannel:
    """Calls on the fast socket at ``path``; raises :class:`Unreachable` from :meth:`call` when
    no connection can be opened (nothing was sent).

    A call takes an idle connection, or opens one, and gives it back when answered: calls from
    several threads run side by side, each within its own deadline (one connection per thread
    calling at once; one in all for a single-threaded engine)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._generation = 0   # a reset's: connections taken before it are not given back
        self._unsettled: set[socket.socket] = set()   # idle ones carrying one-way frames to settle
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        self._owed: dict[socket.socket, int] = {}   # answers not read yet, by connection (see send)
        self._ahead: dict[socket.socket, bytes] = {}   # bytes read of answers after the one read

    def open(self) -> None:
        """Connect now (calls connect when they need to); :class:`Unreachable` when it cannot."""
        sock = self._connect()
        self._give(sock, self._generation)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise Unreachable(f"{self.path}: {exc.strerror or exc}") from None
        return sock

    def _give(self, sock: socket.socket, generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._idle.append(sock)
                return
        sock.close()

    def call(self, method: str, request: Message, response_type: type[M], timeout_s: float | None,
             on: socket.socket | None = None) -> M:
        """``method``'s answer to ``request`` within ``timeout_s`` (None: no deadline); ``on``:
        an idle connection taken out of the pool by the caller (see :meth:`settle`)."""
        return self.answer(self.send(method, request, timeout_s, on), response_type)

    def send(self, method: str, request: Message, timeout_s: float | None, on: socket.socket | None = None,
             after: Sent | None = None) -> Sent:
        """Send ``request`` to ``method`` and return without its answer, which :meth:`answer`
        reads (exactly once). ``after``: a call sent before whose answer is not read yet, to go
        on the same connection (the daemon serves them in order; their answers are read in the
        order they were sent); else an idle connection, or ``on``. Raises FrameCallError, or
        Unreachable when no connection opens (nothing was sent)."""
        body = request.SerializeToString()
        if len(body) > frames.MAX_PAYLOAD_BYTES:
            raise FrameCallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"a request of {len(body)} bytes (at most {frames.MAX_PAYLOAD_BYTES})")
        if timeout_s is not None and timeout_s <= 0:
            raise FrameCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if os.getpid() != self._pid:
            # a forked child: its parent's connections (and their answers) are not its own; the
            # lock is new too (another thread of the parent may have held it at the fork)
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._idle = []
            self._unsettled = set()
            self._owed = {}
            self._ahead = {}
            self._generation += 1
            after = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request_id = next(self._ids)
        frame = frames.REQUEST.pack(len(body), frames.METHOD_IDS[method], request_id, timeout_s or 0.0) + body
        with self._lock:
            if after is not None:
                sock: socket.socket | None = after.sock
                generation = after.generation
            else:
                sock = on if on is not None else self._idle.pop() if self._idle else None
                generation = self._generation
            if sock is not None:   # answered, the call shows its connection's one-way frames served
                self._unsettled.discard(sock)
        if after is not None and sock is not None and sock.fileno() < 0:
            raise FrameCallError(grpc.StatusCode.UNAVAILABLE, f"fast socket {self.path}: the connection of the "
                                 "call before this one failed")
        if sock is not None:
            try:
                if sock.gettimeout() != timeout_s:   # (a syscall or two each time: only when it changes)
                    sock.settimeout(timeout_s)
                sock.sendall(frame)
            except TimeoutError:
                sock.close()
                raise FrameCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            except OSError:
                sock.close()
                if after is not None:
                    raise FrameCallError(grpc.StatusCode.UNAVAILABLE, f"fast socket {self.path}: the "
                                         "connection failed") from None
                # the daemon this connection went to is gone (a restart): nothing reached a
                # daemon, so the call goes again on a new connection (or by gRPC)
                sock = None
        if sock is None:
            sock = self._connect()   # Unreachable: the caller takes gRPC
            try:
                if sock.gettimeout() != timeout_s:
                    sock.settimeout(timeout_s)
                sock.sendall(frame)
            except TimeoutError:
                sock.close()
                raise FrameCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            except OSError as exc:
                sock.close()
                raise FrameCallError(grpc.StatusCode.UNAVAILABLE, f"fast socket {self.path}: "
                                     f"{exc.strerror or exc}") from None
        with self._lock:
            self._owed[sock] = self._owed.get(sock, 0) + 1
        return Sent(sock, request_id, generation, deadline)

    def answer(self, sent: Sent, response_type: type[M]) -> M:
        """The answer to a call :meth:`send` sent (the calls sent before it on its connection
        answered first); the connection goes back to the pool once no answer is owed on it."""
        sock, deadline = sent.sock, sent.deadline
        if deadline is not None and deadline < time.monotonic():
            # an answer read well after its call was sent (saves that did not wait): its own
            # timeout from now, not a deadline that passed while nobody was reading
            deadline = time.monotonic() + (sock.gettimeout() or 0.0)
        try:
            # header and payload in one read when they came together (a small answer always does)
            with self._lock:
                data = self._ahead.pop(sock, b"")
            if len(data) < frames.ANSWER.size:
                data += sock.recv(FIRST_READ)
            if len(data) < frames.ANSWER.size:
                data += self._read(sock, frames.ANSWER.size - len(data), deadline, bool(data))
            length, answered, code = frames.ANSWER.unpack_from(data)
            payload = data[frames.ANSWER.size:]
            if len(payload) < length:
                payload += self._read(sock, length - len(payload), deadline, True)
            elif len(payload) > length:   # the next call's on this connection (see send's after)
                payload, rest = payload[:length], payload[length:]
                with self._lock:
                    self._ahead[sock] = rest
        except TimeoutError:
            # closed, not given back: a late answer is never read as another call's
            self._owing_none(sock)
            sock.close()
            raise FrameCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as exc:
            self._owing_none(sock)
            sock.close()
            raise FrameCallError(grpc.StatusCode.UNAVAILABLE, f"fast socket {self.path}: "
                                 f"{exc.strerror or exc}") from None
        if answered != sent.request_id or length > frames.MAX_PAYLOAD_BYTES or len(payload) != length:
            self._owing_none(sock)
            sock.close()
            raise FrameCallError(grpc.StatusCode.INTERNAL, f"fast socket {self.path}: an answer to request "
                                 f"{answered} of {length} bytes, waiting for {sent.request_id}")
        with self._lock:
            owed = self._owed.pop(sock, 1) - 1
            if owed:
                self._owed[sock] = owed
        if not owed:
            self._give(sock, sent.generation)
        if code == frames.OK:
            return response_type.FromString(payload)
        try:
            status = status_pb2.Status.FromString(payload)
        except DecodeError:
            status = status_pb2.Status(code=code, message="(the daemon's status did not parse)")
        raise FrameCallError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message, payload)

    def _owing_none(self, sock: socket.socket) -> None:
        with self._lock:
            self._owed.pop(sock, None)
            self._ahead.pop(sock, None)

    def send_one_way(self, frame: bytes, settle: bool = False) -> bool:
        """Send ``frame`` (a one-way request: never answered) on an idle connection, the one this
        thread's next call is likely to take, so that the daemon serves it before that call;
        False when none is idle (nothing sent); OSError when the connection fails. ``settle``:
        :meth:`settle` makes sure it was served."""
        if os.getpid() != self._pid:
            return False   # (call() makes a forked child's connections its own)
        with self._lock:
            sock = self._idle.pop() if self._idle else None
            generation = self._generation
        if sock is None:
            return False
        try:
            sock.sendall(frame)
        except OSError:
            sock.close()
            raise
        if settle:
            with self._lock:
                self._unsettled.add(sock)
        self._give(sock, generation)
        return True

    def settle(self, method: str, request: Message, response_type: type[Message], timeout_s: float | None) -> None:
        """Return once the daemon has served the one-way frames sent with ``settle`` on
        connections idle now: a call (``method``, whose answer or failure is ignored) on each of
        them, which the daemon starts after the frames before it. (A connection in use settles
        with its call's answer.) A daemon that does not answer within ``timeout_s`` raises
        :class:`FrameCallError` (DEADLINE_EXCEEDED), as the call after this would."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            todo = [sock for sock in self._idle if sock in self._unsettled]
            for sock in todo:
                self._idle.remove(sock)
        for sock in todo:
            try:
                self.call(method, request, response_type, timeout_s, on=sock)
            except FrameCallError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    with self._lock:   # (the others stay to settle)
                        self._idle.extend(s for s in todo[todo.index(sock) + 1:])
                    raise
            except Unreachable:
                pass   # the connection is gone, and its daemon with it

    def _read(self, sock: socket.socket, n: int, deadline: float | None, started: bool) -> bytes:
        """Exactly ``n`` more bytes, by ``deadline`` (``started``: a read since the call's first
        has returned data, so the socket's timeout is no longer the time left); OSError (EOF
        included) or TimeoutError."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            if started and deadline is not None:
                sock.settimeout(max(1e-6, deadline - time.monotonic()))
            data = sock.recv(min(n - got, 1 << 20))
            if not data:
                raise ConnectionResetError(0, "the daemon closed the connection")
            parts.append(data)
            got += len(data)
            started = True
        return b"".join(parts)

    def reset(self) -> None:
        """Forget the connections (their daemon went away): the next call opens a new one."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._unsettled.clear()
            self._generation += 1
        for sock in idle:
            sock.close()

    def close(self) -> None:
        self.reset()
