"""The router process: subscribers feeding the global index, membership dropping dead nodes,
and the HTTP API over the router. Runs on one event loop; the index and the router belong to it.

gRPC (``router.grpc``): :mod:`kvstored.router.grpc_api`.
HTTP: ``POST /v1/route`` (a route request, :mod:`kvstored.router.json_api`) answers the chosen
node and each candidate's breakdown; ``POST /v1/report`` takes a node's queued prefill work and
measured prefills; ``GET /v1/nodes`` the state of each node's stream; ``GET /healthz``. Bad input
gets 400 with ``{"error", "reason"}``; no available node gets 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import grpc
import zmq.asyncio

from kvstored.cluster.membership import EtcdMembership, Member, MembershipError
from kvstored.config import Config, parse_source
from kvstored.policy.cost import shape_for
from kvstored.policy.routing import NodeCosts
from kvstored.router.calibration import Calibration
from kvstored.router.grpc_api import add_servicers
from kvstored.router.http_server import JsonHttpServer
from kvstored.router.index import GlobalIndex
from kvstored.router.json_api import Report, answer_to_json, query_from_json, report_from_json
from kvstored.router.load import LoadBoard
from kvstored.router.reports import NodeReports
from kvstored.router.router import Defaults, RouteError, Router
from kvstored.router.subscriber import Source, Subscriber
from kvstored.rpc_guard import BadRequests, RequestGuard
from kvstored_client.contract.namespace import Namespace

log = logging.getLogger("kvstored.router")


def sources_of(cfg: Config) -> list[Source]:
    r = cfg.router
    out = []
    for entry in r.sources:
        node, pub, replay = parse_source(entry)
        out.append(Source(node, pub, replay))
    engine_ns = Namespace(model=r.engine_model, block_size=r.engine_block_size).identity()
    for entry in r.engines:
        node, pub, replay = parse_source(entry)
        out.append(Source(node, pub, replay, namespace_id=engine_ns, heartbeats=False, stream="gpu"))
    return out


class RouterService:
    def __init__(self, cfg: Config, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        r = cfg.router
        self._cfg = cfg
        self._clock = clock
        self.index = GlobalIndex()
        self.reports = NodeReports()
        self.load = LoadBoard(clock)
        self.calibration = Calibration(r.prefill_flops_per_s)
        self._ctx = zmq.asyncio.Context()
        self.subscribers = [Subscriber(s, self.index, self._ctx, clock, r.heartbeat_timeout_s, self.reports.heard)
                            for s in sources_of(cfg)]
        self._members: set[str] | None = None   # None: no membership service, every source counts
        defaults = Defaults(NodeCosts(queue_s=0.0, prefill_flops_per_s=r.prefill_flops_per_s, decode_s=r.decode_s,
                                      peer_bytes_per_s=r.peer_bytes_per_s), spread=r.spread)
        self.router = Router(self.index, self.load, self.calibration, self.reports, self.available, rng, defaults)
        self.http = JsonHttpServer({("POST", "/v1/route"): self._route, ("POST", "/v1/report"): self._report,
                                    ("GET", "/v1/nodes"): self._nodes, ("GET", "/healthz"): self._health})
        self._membership: EtcdMembership | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._grpc: grpc.aio.Server | None = None
        self.port = 0
        self.grpc_port = 0

    def available(self) -> list[str]:
        """Nodes a request may go to: a daemon stream in sync (an engine-only node once its
        stream is), and a member where membership is known."""
        up = {s.source.node for s in self.subscribers if s.up}
        return sorted(up if self._members is None else up & self._members)

    async def start(self) -> None:
        host, _, port = self._cfg.router.listen.rpartition(":")
        self.port = await self.http.start(host.strip("[]"), int(port))
        if self._cfg.router.grpc:
            self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                         interceptors=[RequestGuard(BadRequests())])
            add_servicers(self._grpc, self.router, self.report)
            self.grpc_port = self._grpc.add_insecure_port(self._cfg.router.grpc)
            if not self.grpc_port:
                raise OSError(f"cannot listen on router.grpc {self._cfg.router.grpc}")
            await self._grpc.start()
        for sub in self.subscribers:
            sub.start()
        etcd = self._cfg.router.etcd or self._cfg.peers.etcd
        if etcd:
            self._membership = EtcdMembership(etcd, "kvstored-router", "", register=False)
            await self._membership.start()
            self._tasks.append(asyncio.ensure_future(self._watch_members()))

    async def _watch_members(self) -> None:
        assert self._membership is not None
        async for members in self._membership.watch():
            self.members_changed(members)

    def members_changed(self, members: tuple[Member, ...]) -> None:
        """A node whose membership ended (its etcd lease expired) is dropped from the index at once."""
        now = {m.node_id for m in members}
        for sub in self.subscribers:
            if sub.source.node not in now and (self._members is None or sub.source.node in self._members):
                sub.drop("its membership ended")
        self._members = now

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._membership is not None:
            with contextlib.suppress(MembershipError, OSError):
                await self._membership.close()
        for sub in self.subscribers:
            await sub.close()
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        await self.http.close()
        self._ctx.term()

    # -- HTTP handlers ------------------------------------------------------------------------
    async def _route(self, body: Any) -> tuple[int, Any]:
        try:
            answer = self.router.route(query_from_json(body))
        except RouteError as exc:
            return (503 if exc.reason == "no_candidate" else 400), {"error": str(exc), "reason": exc.reason}
        return 200, answer_to_json(answer)

    async def _report(self, body: Any) -> tuple[int, Any]:
        try:
            report = report_from_json(body)
        except RouteError as exc:
            return 400, {"error": str(exc), "reason": exc.reason}
        self.report(report)
        return 200, {"ok": True}

    def report(self, report: Report) -> None:
        """A node's queued prefill work and measured prefills (HTTP or gRPC)."""
        if report.queued_prefill_s is not None:
            self.load.report(report.node, report.queued_prefill_s)
        for p in report.prefills:
            self.calibration.observe(report.node, shape_for(p.model), p.tokens, p.cached_tokens, p.seconds)

    async def _nodes(self, _body: Any) -> tuple[int, Any]:
        nodes = []
        for sub in self.subscribers:
            s = sub.stream
            speed = self.calibration.speed(sub.source.node)
            nodes.append({"node": sub.source.node, "source": sub.source.name, "up": sub.up,
                          "epoch": s.epoch, "in_sync": s.in_sync, "gaps": s.gaps, "resyncs": s.resyncs,
                          "replays": sub.replays, "snapshots": sub.snapshots, "bad_frames": sub.bad_frames,
                          "member": self._members is None or sub.source.node in self._members,
                          "queue_s": self.load.queue_s(sub.source.node),
                          "prefill_flops_per_s": speed.flops_per_s, "prefill_samples": speed.samples})
        return 200, {"nodes": nodes, "available": self.available(), "index_entries": self.index.entries(),
                     "index_bytes": self.index.nbytes, "routed": self.router.routed}

    async def _health(self, _body: Any) -> tuple[int, Any]:
        return 200, {"status": "serving", "available": len(self.available())}
