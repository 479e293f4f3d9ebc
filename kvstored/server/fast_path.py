"""The fast path: the hot unary calls in length-prefixed frames on a second Unix socket.

The wire format is the SDK's (:mod:`kvstored_client.contract.frames`). Each request runs as a
task of its own on the daemon's loop, through the gRPC servicer's own handler for its method (the
one under ``@mapped``), so both listeners share one code path per method, and as gRPC's do: its
refusals counted in ``kvstored_bad_requests_total`` (the request guard's counter), its failure
mapped to a status in the one place that does it (``status_message``), its deadline honoured (the
frame's budget: the handler is cancelled when it passes and the answer is DEADLINE_EXCEEDED), its
time in the per-method latency histogram. A frame that cannot be a request (too long, a budget
that is not a number of seconds) is counted and ends its connection; a connection's end cancels
its calls in flight, as a cancelled gRPC call is.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2

from kvstored.rpc_guard import BadRequests, hear_refusals, heard, malformed
from kvstored.server.status import status_message
from kvstored_client.contract import frames
from kvstored_client.contract.errors import DaemonNotRunning, DeadlineExceeded, KVStoreError, Reason

log = logging.getLogger("kvstored.server")
Handler = Callable[[Any, "FrameContext"], Awaitable[Any]]
Observe = Callable[[float], None]
_PEERCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
MAX_CALLS_IN_FLIGHT = 64   # a connection's calls running at once (the SDK runs one per connection)


class FrameContext:
    """What a handler asks of its call, as gRPC's context answers it: the time left before the
    call's deadline (None: it has none)."""

    __slots__ = ("_loop", "deadline", "expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, budget_s: float) -> None:
        self._loop = loop
        self.deadline = loop.time() + budget_s if budget_s else None
        self.expired = False   # the deadline passed and the call was cancelled for it

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self._loop.time())


class FastPath:
    """Serves :data:`frames.METHODS` of ``servicer`` on a Unix socket (:meth:`start`)."""

    def __init__(self, servicer: object, bad_requests: BadRequests,
                 observe: Callable[[str], Observe] | None = None) -> None:
        self.bad_requests = bad_requests
        self.handlers: dict[int, tuple[str, type[Message], Handler, Observe | None]] = {}
        for method_id, (name, request_type, _) in frames.METHODS.items():
            # the handler under @mapped: a failure is answered here, not by gRPC's abort
            raw = getattr(servicer, name).__wrapped__
            self.handlers[method_id] = (name, request_type, raw.__get__(servicer),
                                        observe(name) if observe is not None else None)
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None

    async def start(self, path: Path, mode: int) -> None:
        """Listen on ``path`` with file mode ``mode`` (bound under the matching umask: no moment
        at which others may connect). OSError when it cannot."""
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o777 & ~mode)
        try:
            self._server = await loop.create_unix_server(lambda: _Connection(self), str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, mode)

    def stop_accepting(self) -> None:
        """No new connections; calls that come on open ones are answered DAEMON_STOPPING."""
        self.stopping = True
        if self._server is not None:
            self._server.close()

    def close(self) -> None:
        """End every connection (their calls in flight are cancelled)."""
        self.stop_accepting()
        for connection in list(self.connections):
            connection.close()


class _Connection(asyncio.Protocol):
    """One client's connection: frames in, a task per request, answers out as they are ready.

    Reading pauses while MAX_CALLS_IN_FLIGHT of its calls run or its answers wait to be read (the
    transport's write buffer is full): a client that sends and never reads holds a bounded share
    of the daemon's memory, as gRPC's flow control bounds it."""

    def __init__(self, fast: FastPath) -> None:
        self._fast = fast
        self._buffer = bytearray()
        self._calls: set[asyncio.Task[None]] = set()
        self._writing_paused = False
        self._reading_paused = False
        self._transport: asyncio.Transport | None = None
        self._client = "unix:fast"
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)   # (uvloop's is one without subclassing it)
        self._fast.connections.add(self)
        sock = transport.get_extra_info("socket")
        try:   # who is calling, for the bad-request log: the kernel's word, not the client's
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            self._client = f"unix:fast pid {pid} uid {uid}"
        except (AttributeError, OSError, struct.error):
            pass

    def connection_lost(self, exc: Exception | None) -> None:
        self._fast.connections.discard(self)
        self._transport = None
        for call in list(self._calls):
            call.cancel()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._pace()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._pace()

    def _pace(self) -> None:
        """Pause or resume reading by the calls in flight and the answers not yet read; frames
        already read are started as soon as reading may resume."""
        if self._transport is None or self._transport.is_closing():
            return
        pause = self._writing_paused or len(self._calls) >= MAX_CALLS_IN_FLIGHT
        if pause != self._reading_paused:
            self._reading_paused = pause
            if pause:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()
                self._start_calls()

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        if self._reading_paused:
            self._pace()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._start_calls()

    def _start_calls(self) -> None:
        """A task for each whole frame read, until reading must pause."""
        if self._transport is None or self._transport.is_closing():
            return
        buf = self._buffer
        header = frames.REQUEST.size
        while len(buf) >= header and not self._reading_paused:
            length, method_id, request_id, budget = frames.REQUEST.unpack_from(buf)
            if length > frames.MAX_PAYLOAD_BYTES or not (math.isfinite(budget) and budget >= 0):
                detail = (f"a frame of {length} bytes (at most {frames.MAX_PAYLOAD_BYTES})"
                          if length > frames.MAX_PAYLOAD_BYTES else f"a deadline budget of {budget!r} s")
                self._fast.bad_requests.record("(frame)", "malformed_frame", self._client, detail)
                buf.clear()
                self._transport.close()
                return
            end = header + length
            if len(buf) < end:
                return
            payload = bytes(buf[header:end])
            del buf[:end]
            task = self._loop.create_task(self._serve(method_id, request_id, budget, payload))
            self._calls.add(task)
            task.add_done_callback(self._call_done)
            if len(self._calls) >= MAX_CALLS_IN_FLIGHT:
                self._pace()

    async def _serve(self, method_id: int, request_id: int, budget: float, payload: bytes) -> None:
        one_way = bool(method_id & frames.ONE_WAY)
        entry = self._fast.handlers.get(method_id & ~frames.ONE_WAY)
        if entry is None:   # as gRPC answers a method it does not serve (not the client's mistake)
            if one_way:
                return
            unimplemented = status_pb2.Status(code=UNIMPLEMENTED, message=f"no method {method_id} on the fast path")
            self._answer(request_id, UNIMPLEMENTED, unimplemented.SerializeToString())
            return
        name, request_type, handler, observe = entry
        started = time.perf_counter()
        hear_refusals(self._fast.bad_requests, name, self._client)
        context = FrameContext(self._loop, budget)
        timer = None
        if context.deadline is not None:
            task = asyncio.current_task()
            assert task is not None

            def expire() -> None:
                context.expired = True
                task.cancel()
            timer = self._loop.call_at(context.deadline, expire)
        try:
            try:
                if self._fast.stopping:
                    raise DaemonNotRunning("kvstored is shutting down", Reason.DAEMON_STOPPING)
                try:
                    request = request_type.FromString(payload)
                except DecodeError as exc:
                    raise malformed(str(exc)) from None
                response = await handler(request, context)
            except asyncio.CancelledError:
                if not context.expired:
                    raise   # the connection ended: nobody to answer
                raise DeadlineExceeded(f"the call's deadline ({budget:g} s) passed in the daemon") from None
            except KVStoreError:
                raise
            except Exception as exc:   # a bug, as gRPC's UNKNOWN "Unexpected ..." (with its traceback)
                log.exception("fast path: %s failed", name)
                raise KVStoreError(f"Unexpected {type(exc)}: {exc}") from None
        except KVStoreError as exc:
            heard(exc)
            if not one_way:
                status = status_message(exc)
                self._answer(request_id, status.code, status.SerializeToString())
        else:
            if not one_way:
                self._answer(request_id, frames.OK, response.SerializeToString())
        finally:
            if timer is not None:
                timer.cancel()
            if observe is not None:
                observe(time.perf_counter() - started)

    def _answer(self, request_id: int, code: int, body: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frames.ANSWER.pack(len(body), request_id, code) + body)
