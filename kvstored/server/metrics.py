"""Prometheus metrics: the store's counters and gauges, served over HTTP (``server.metrics``).

The HTTP server is prometheus-client's WSGI app on a thread of its own; a scrape asks the event
loop for a snapshot of the counters (the store's state belongs to the loop), so a scrape never
reads them half-updated, and a loop that cannot answer in time fails that scrape with HTTP 503
and one log line. Names carry the ``kvstored_`` prefix and base units (bytes, seconds, blocks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvstored.store import StoreStats

SCRAPE_TIMEOUT_S = 5.0   # a loop that cannot answer in this time fails the scrape, not the daemon
log = logging.getLogger(__name__)


class ScrapeTimeout(Exception):
    """The event loop did not hand a scrape its snapshot in time."""
# Buckets from 100 µs (a lookup) to 30 s (a long stream from a peer), in seconds.
RPC_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


_Kind = type[CounterMetricFamily] | type[GaugeMetricFamily]
_C, _G = CounterMetricFamily, GaugeMetricFamily   # a counter's name gets _total when exposed

# (kind, name after kvstored_, help, attribute of TierStats / StoreStats / Snapshot)
_TIER_METRICS: list[tuple[_Kind, str, str, str]] = [
    (_G, "tier_capacity_bytes", "Bytes a tier may hold.", "capacity_bytes"),
    (_G, "tier_used_bytes", "Bytes a tier holds now.", "used_bytes"),
    (_G, "tier_blocks", "Blocks a tier holds now.", "blocks"),
    (_C, "tier_evictions", "Blocks evicted from a tier.", "evictions"),
    (_C, "tier_write_errors", "Block writes a tier failed.", "write_errors"),
    (_C, "tier_read_errors", "Block reads a tier failed (checksum mismatches included).", "read_errors"),
]
_STORE_METRICS: list[tuple[_Kind, str, str, str]] = [
    (_C, "lookups", "Lookups served.", "lookups"),
    (_C, "lookup_blocks", "Blocks asked for by lookups and loads.", "lookup_blocks"),
    (_C, "hit_blocks", "Blocks found cached by lookups and loads.", "hit_blocks"),
    (_C, "hit_tokens", "Tokens whose KV was found cached.", "hit_tokens"),
    (_C, "saved_blocks", "Blocks stored by clients.", "saved_blocks"),
    (_C, "promotions", "Blocks brought from SSD to DRAM.", "promotions"),
    (_C, "demotions", "Blocks written from DRAM to SSD.", "demotions"),
    (_C, "peer_fetched_blocks", "Blocks fetched from peers.", "peer_fetched_blocks"),
    (_C, "peer_served_blocks", "Blocks served to peers.", "peer_served_blocks"),
    (_C, "peer_received_blocks", "Blocks peers pushed here.", "peer_received_blocks"),
    (_G, "uptime_seconds", "Seconds since the daemon started.", "uptime_s"),
    (_G, "active_leases", "Read leases held by clients now.", "active_leases"),
    (_G, "clients", "Client sessions open now.", "clients"),
    (_G, "namespaces", "Namespaces known.", "namespaces"),
    (_G, "index_blocks", "Blocks in the prefix index.", "index_blocks"),
]
# exposed with labels, by StoreCollector.collect itself
LABELLED_METRICS = ("kvstored_dropped_blocks_total", "kvstored_room_wait_seconds", "kvstored_bad_requests_total")
_PEER_METRICS: list[tuple[_Kind, str, str, str]] = [
    (_C, "peer_pushed_blocks", "Blocks pushed to peers.", "peer_pushed_blocks"),
    (_C, "peer_failures", "Failed exchanges with peers.", "peer_failures"),
]
_EVENT_METRICS: list[tuple[_Kind, str, str, str]] = [
    (_C, "events_sent", "KV events published ([events]).", "events_sent"),
    (_C, "events_dropped", "KV events dropped: the sender's queue or a subscriber's buffer was full.",
     "events_dropped"),
]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one scrape reports: the store's stats and the peer counters kept outside it."""

    store: StoreStats
    peer_pushed_blocks: int = 0
    peer_failures: int = 0
    events_sent: int = 0
    events_dropped: int = 0


class StoreCollector(Collector):
    """Turns a :class:`Snapshot`, taken on ``loop`` by ``snapshot``, into metric families."""

    def __init__(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], Snapshot]) -> None:
        self._loop = loop
        self._snapshot = snapshot

    def _take(self) -> Snapshot:
        async def take() -> Snapshot:
            return self._snapshot()
        fut = asyncio.run_coroutine_threadsafe(take(), self._loop)
        try:
            return fut.result(SCRAPE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise ScrapeTimeout(f"metrics scrape failed: the event loop did not answer within "
                                f"{SCRAPE_TIMEOUT_S:g} s (busy or blocked)") from None

    def collect(self) -> Iterator[Metric]:
        snap = self._take()
        for kind, name, doc, attr in _TIER_METRICS:
            family = kind(f"kvstored_{name}", doc, labels=["tier"])
            for tier in snap.store.tiers:
                family.add_metric([tier.name], getattr(tier, attr))
            yield family
        for kind, name, doc, attr in _STORE_METRICS:
            yield kind(f"kvstored_{name}", doc, value=getattr(snap.store, attr))
        for kind, name, doc, attr in _PEER_METRICS + _EVENT_METRICS:
            yield kind(f"kvstored_{name}", doc, value=getattr(snap, attr))
        by_reason = CounterMetricFamily(
            "kvstored_dropped_blocks", "Blocks whose last copy went, by why: refused (ssd.admission), ssd_off, "
            "ssd_full, write_error, ssd_evicted, corrupt, unreadable.", labels=["reason"])
        for reason, n in sorted(snap.store.dropped_by_reason.items()):
            by_reason.add_metric([reason], n)
        yield by_reason
        waits = snap.store.room_waits
        if waits is not None:
            cumulative, buckets = 0, []
            for bound, n in zip(waits.bounds, waits.counts):
                cumulative += n
                buckets.append((repr(bound), cumulative))
            buckets.append(("+Inf", waits.count))
            yield HistogramMetricFamily("kvstored_room_wait_seconds",
                                        "How long saves waited for the write-back to make room in DRAM.",
                                        buckets=buckets, sum_value=waits.sum_s)


class RpcTimer(grpc.aio.ServerInterceptor):
    """Times every unary and server-streaming call into ``kvstored_rpc_duration_seconds{method}``
    (a stream: from the request to its last message; a migration longer than the last bucket
    counts in +Inf). Session streams, which last as long as their client, are not timed."""

    def __init__(self) -> None:
        self.histogram = Histogram("kvstored_rpc_duration_seconds", "Time to serve a call, by method.",
                                   ["method"], buckets=RPC_BUCKETS, registry=None)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        observe = self.histogram.labels(handler_call_details.method.rpartition("/")[2]).observe
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def timed_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                try:
                    return await unary(request, context)
                finally:
                    observe(time.perf_counter() - start)

            return grpc.unary_unary_rpc_method_handler(timed_unary, handler.request_deserializer,
                                                       handler.response_serializer)
        streaming = handler.unary_stream
        if streaming is None or not inspect.isasyncgenfunction(streaming):
            return handler   # (every server stream of ours is an async generator)

        async def timed_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                async for message in streaming(request, context):
                    yield message
            finally:
                observe(time.perf_counter() - start)

        return grpc.unary_stream_rpc_method_handler(timed_stream, handler.request_deserializer,
                                                    handler.response_serializer)


def serve_metrics(address: str, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], Snapshot],
                  timer: RpcTimer | None = None, counters: Iterable[Collector] = ()) -> WSGIServer:
    """Serve ``/metrics`` on ``address`` ("host:port"; port 0 picks one: see ``server_address``)
    from a thread of its own, with ``timer``'s histogram and ``counters`` (kept off the loop's
    snapshot: they count on their own); stop it with ``shutdown()`` then ``server_close()``.
    Raises OSError when the address cannot be bound."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(loop, snapshot))
    if timer is not None:
        registry.register(timer.histogram)
    for counter in counters:
        registry.register(counter)

    # The family the address resolves to, as prometheus-client's own server chose it: a host name
    # may resolve to IPv6 only (a name without a ':' is not necessarily IPv4).
    family, _, _, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(str(sockaddr[0]), int(port), _unavailable_on_timeout(make_wsgi_app(registry)), Server,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def _unavailable_on_timeout(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """``app``, answering a scrape whose snapshot timed out with 503 and one log line (not a
    500 with a traceback in the journal)."""
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            return app(environ, start_response)
        except ScrapeTimeout as exc:
            log.warning("%s", exc)
            start_response("503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"{exc}\n".encode()]
    return wrapped


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a scrape every few seconds)."""
