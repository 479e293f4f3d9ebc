"""Hostile input on a gRPC listener (the daemon's, the router's), handled once for every method.

A request whose bytes are not the method's message ends INVALID_ARGUMENT (reason
MALFORMED_REQUEST), not grpc's UNKNOWN "Unexpected DecodeError" with a traceback in the log. A
client's mistakes (every INVALID_ARGUMENT) cost the log one line per client and kind per interval;
all of them are counted in ``kvstored_bad_requests_total{method,kind}``. A traceback is left for
what is not the client's doing: an exception a handler did not expect is the process's bug.

How a refusal ends the call is the server's (``end``): the daemon's carries its reason in the
rich status (kvstored/server/status.py), the router's is a plain status; either tells
:func:`heard` first, so that the refusal is counted wherever in a handler it was raised.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from kvstored_client.contract.errors import InvalidArgument, KVStoreError, Reason

log = logging.getLogger(__name__)
LOG_INTERVAL_S = 60.0
MAX_DETAIL_CHARS = 200    # a refusal's message may echo the request: the log line stays short
MAX_CLIENTS = 1024        # (client, kind) windows kept; past it, refusals of new ones are counted only
End = Callable[[grpc.aio.ServicerContext, KVStoreError], Awaitable[None]]

# Who hears of each refusal of the call running in this task: set by the guard, which knows the
# method and the client, when the call starts (each call runs in a task of its own).
_refusals: contextvars.ContextVar[Callable[[KVStoreError], None] | None] = contextvars.ContextVar(
    "kvstored_refusals", default=None)


def heard(exc: KVStoreError) -> None:
    """Tell the call's guard that the call is refused with ``exc`` (does nothing outside a call)."""
    hear = _refusals.get()
    if hear is not None:
        hear(exc)


def hear_refusals(bad: BadRequests, method: str, client: str) -> None:
    """From here on in this task (a call), count each of its refusals that is the client's
    mistake (INVALID_ARGUMENT) in ``bad`` as ``method``'s, from ``client``: every listener's
    calls (gRPC's, the fast path's) are counted the same way."""
    def count(exc: KVStoreError) -> None:
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
            bad.record(method, str(exc.reason).lower(), client, str(exc))
    _refusals.set(count)


async def plain_abort(context: grpc.aio.ServicerContext, exc: KVStoreError) -> None:
    """End the call with ``exc``'s status code and message, no details (a service without reasons)."""
    heard(exc)
    await context.abort(exc.code or grpc.StatusCode.UNKNOWN, str(exc))


@dataclass(frozen=True, slots=True)
class Malformed:
    """What a unary request that did not parse is handed on as: grpc parses it before any
    handler runs, and an exception there is grpc's UNKNOWN with a traceback."""

    detail: str


@dataclass(frozen=True, slots=True)
class _Window:
    start: float
    suppressed: int


class BadRequests:
    """Counts client mistakes and logs them, one line per (client, kind) per ``interval_s`` on
    ``clock``; the line says how many like it went unlogged since the last one."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS) -> None:
        self.counter = Counter("kvstored_bad_requests", "Requests refused as the client's mistake "
                               "(INVALID_ARGUMENT), by method and kind (the reason, lower case).",
                               ["method", "kind"], registry=None)
        self._interval_s = interval_s
        self._clock = clock
        self._max_clients = max_clients
        self._windows: dict[tuple[str, str], _Window] = {}

    def record(self, method: str, kind: str, client: str, detail: str) -> None:
        self.counter.labels(method, kind).inc()
        now = self._clock()
        key = (client, kind)
        window = self._windows.get(key)
        if window is not None and now - window.start < self._interval_s:
            self._windows[key] = _Window(window.start, window.suppressed + 1)
            return
        if window is None and len(self._windows) >= self._max_clients:
            self._windows = {k: w for k, w in self._windows.items() if now - w.start < self._interval_s}
            if len(self._windows) >= self._max_clients:
                return   # many clients at once: the counter has them all
        self._windows[key] = _Window(now, 0)
        more = f" ({window.suppressed} more like it not logged)" if window is not None and window.suppressed else ""
        # quoted and cut: the detail may echo what the client sent (newlines, a model name of megabytes)
        log.warning("bad request from %.80r: %s: %s: %.*r%s", client, method, kind, MAX_DETAIL_CHARS, detail, more)


class RequestGuard(grpc.aio.ServerInterceptor):
    """Wraps every method's request parser and handler (all of them async): see the module's
    docstring."""

    def __init__(self, bad_requests: BadRequests, end: End = plain_abort) -> None:
        self.bad_requests = bad_requests
        self._end = end

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rpartition("/")[2]
        parse = handler.request_deserializer
        bad = self.bad_requests
        end = self._end

        def hear(context: grpc.aio.ServicerContext) -> None:
            hear_refusals(bad, method, _client(context.peer()))


        if not handler.request_streaming:
            def parse_unary(raw: bytes) -> Any:
                try:
                    return parse(raw) if parse is not None else raw
                except DecodeError as exc:
                    return Malformed(str(exc))

            def refuse(request: Any) -> KVStoreError | None:
                return malformed(request.detail) if isinstance(request, Malformed) else None

            if handler.unary_unary is not None:
                return grpc.unary_unary_rpc_method_handler(_guarded(handler.unary_unary, hear, refuse, end),
                                                           parse_unary, handler.response_serializer)
            return grpc.unary_stream_rpc_method_handler(_guarded(handler.unary_stream, hear, refuse, end),
                                                        parse_unary, handler.response_serializer)

        # A streamed request is parsed as the handler reads it: a failure is raised in the
        # handler, as the refusal it is, and ends the call from there.
        def parse_streamed(raw: bytes) -> Any:
            try:
                return parse(raw) if parse is not None else raw
            except DecodeError as exc:
                raise malformed(str(exc)) from None

        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_guarded(handler.stream_unary, hear, None, end),
                                                        parse_streamed, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(_guarded(handler.stream_stream, hear, None, end),
                                                     parse_streamed, handler.response_serializer)


def malformed(detail: str) -> InvalidArgument:
    """The refusal of a request whose bytes are not the method's message."""
    return InvalidArgument(f"the request does not parse: {detail}", Reason.MALFORMED_REQUEST)


def _client(peer: str) -> str:
    """gRPC's peer without its port ("ipv4:10.0.0.1:5555" -> "ipv4:10.0.0.1"): one client however
    many connections it opens; a Unix socket's peer as it is."""
    kind, _, rest = peer.partition(":")
    return f"{kind}:{rest.rpartition(':')[0]}" if kind in ("ipv4", "ipv6") and ":" in rest else peer


def _guarded(behaviour: Callable[..., Any], hear: Callable[[grpc.aio.ServicerContext], None],
             refuse: Callable[[Any], KVStoreError | None] | None, end: End) -> Callable[..., Any]:
    """``behaviour`` (a coroutine or async generator function of (request, context)) with the
    call's refusals heard, a refused request (``refuse``) ended before it runs, and a refusal
    raised out of it (a streamed request that did not parse) ended by ``end``."""
    if inspect.isasyncgenfunction(behaviour):
        async def generator(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            hear(context)
            refused = refuse(request) if refuse is not None else None
            if refused is not None:
                await end(context, refused)
            try:
                async for message in behaviour(request, context):
                    yield message
            except KVStoreError as exc:
                await end(context, exc)
        return generator

    async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
        hear(context)
        refused = refuse(request) if refuse is not None else None
        if refused is not None:
            await end(context, refused)
        try:
            return await behaviour(request, context)
        except KVStoreError as exc:
            await end(context, exc)
    return coroutine
