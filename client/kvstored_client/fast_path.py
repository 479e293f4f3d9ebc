"""The SDK's end of the fast path: the hot unary calls in frames on the daemon's fast socket.

One blocking Unix socket per client, one call at a time on it (a lock: calls from several threads
take turns). A failed call raises :class:`FrameCallError`, a ``grpc.RpcError`` carrying the
daemon's status as gRPC would (code, message, ``grpc-status-details-bin``), so the one place that
maps gRPC failures to SDK errors (``kvstored_client/errors.py``) maps these too. A call whose
deadline passes, or whose connection breaks, closes the socket (a late answer is never read as
the next call's); the next call connects again.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2

from kvstored_client.contract import frames

M = TypeVar("M", bound=Message)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
DETAILS_KEY = "grpc-status-details-bin"


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


class Unreachable(Exception):
    """The fast socket cannot be opened (gone, refused, not permitted): use gRPC for the call."""


class FastChannel:
    """Calls on the fast socket at ``path``; raises :class:`Unreachable` from :meth:`call` when
    no connection can be opened (nothing was sent)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_id = 1

    def open(self) -> None:
        """Connect now (calls connect when they need to); :class:`Unreachable` when it cannot."""
        with self._lock:
            if self._sock is None:
                self._sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise Unreachable(f"{self.path}: {exc.strerror or exc}") from None
        return sock

    def call(self, method: str, request: Message, response_type: type[M], timeout_s: float | None) -> M:
        """``method``'s answer to ``request`` within ``timeout_s`` (None: no deadline)."""
        body = request.SerializeToString()
        if len(body) > frames.MAX_PAYLOAD_BYTES:
            raise FrameCallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"a request of {len(body)} bytes (at most {frames.MAX_PAYLOAD_BYTES})")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            sock = self._sock
            if sock is None:
                sock = self._sock = self._connect()
            request_id = self._next_id
            self._next_id += 1
            try:
                sock.settimeout(timeout_s)
                sock.sendall(frames.REQUEST.pack(len(body), frames.METHOD_IDS[method], request_id,
                                                 timeout_s or 0.0) + body)
                length, answered, code = frames.ANSWER.unpack(self._read(sock, frames.ANSWER.size, deadline))
                payload = self._read(sock, length, deadline) if length else b""
            except TimeoutError:
                self._drop()
                raise FrameCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            except OSError as exc:
                self._drop()
                raise FrameCallError(grpc.StatusCode.UNAVAILABLE, f"fast socket {self.path}: "
                                     f"{exc.strerror or exc}") from None
            if answered != request_id or length > frames.MAX_PAYLOAD_BYTES:
                self._drop()
                raise FrameCallError(grpc.StatusCode.INTERNAL, f"fast socket {self.path}: an answer to request "
                                     f"{answered} of {length} bytes, waiting for {request_id}")
        if code == frames.OK:
            return response_type.FromString(payload)
        try:
            status = status_pb2.Status.FromString(payload)
        except DecodeError:
            status = status_pb2.Status(code=code, message="(the daemon's status did not parse)")
        raise FrameCallError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message, payload)

    def _read(self, sock: socket.socket, n: int, deadline: float | None) -> bytes:
        """Exactly ``n`` bytes, by ``deadline``; OSError (EOF included) or TimeoutError."""
        data = sock.recv(n)
        if len(data) == n:
            return data
        parts = [data]
        got = len(data)
        while True:
            if not data:
                raise ConnectionResetError(0, "the daemon closed the connection")
            if got == n:
                return b"".join(parts)
            if deadline is not None:
                sock.settimeout(max(1e-6, deadline - time.monotonic()))
            data = sock.recv(min(n - got, 1 << 20))
            parts.append(data)
            got += len(data)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
