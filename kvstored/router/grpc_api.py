"""The router over gRPC: ``kvstored.v1.Router`` (Route, Report: the HTTP API's calls) and llm-d's
``indexer.v1.IndexerService/GetPodScores``, so that an llm-d gateway can use this router as its
KV-cache scorer. Servicers translate messages to the router's values and back; no logic.

GetPodScores takes ``prompt`` as token ids separated by spaces or commas (the router has no
tokenizer: llm-d's own indexer tokenizes with the model's), ``model_name`` as the namespace's
model, and scores each pod asked about (all available ones when none) by its estimated TTFT:
``best TTFT / its TTFT``, 1.0 for the best, lower for slower, 0 for a pod the router does not
know or that is down.
"""

from __future__ import annotations

from typing import Any

import grpc

from kvstored.router.json_api import Prefill, Report
from kvstored.router.proto import indexer_pb2, indexer_pb2_grpc, router_pb2, router_pb2_grpc
from kvstored.router.router import RouteAnswer, RouteError, RouteQuery, Router
from kvstored_client.contract.namespace import Namespace

_STATUS = {"invalid_argument": grpc.StatusCode.INVALID_ARGUMENT, "no_candidate": grpc.StatusCode.UNAVAILABLE}


def namespace_of(ns: router_pb2.RouteNamespace) -> Namespace:
    tp_size = 0 if ns.full_shard else (ns.tp_size or 1)
    return Namespace(model=ns.model or "default", revision=ns.revision, kv_dtype=ns.kv_dtype,
                     block_size=ns.block_size or 16, layout=ns.layout, tp_rank=ns.tp_rank, tp_size=tp_size,
                     hash_algo=ns.hash_algo or "sha256_cbor", hash_seed=ns.hash_seed or "0")


def answer_message(answer: RouteAnswer) -> router_pb2.RouteResponse:
    return router_pb2.RouteResponse(
        node=answer.node, namespace_id=answer.namespace_id, blocks=answer.blocks, tokens=answer.tokens,
        candidates=[router_pb2.Candidate(node=c.node, ttft_s=c.ttft_s, queue_s=c.queue_s, prefill_s=c.prefill_s,
                                         fetch_s=c.fetch_s, decode_s=c.decode_s, cached_blocks=c.cached_blocks,
                                         local_blocks=c.local_blocks, pulled_blocks=c.pulled_blocks,
                                         pull_from=c.pull_from) for c in answer.candidates])


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, report: Any) -> None:
        self._router = router
        self._report = report   # (Report) -> None, as the HTTP API applies one

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> Any:
        hashes: list[int | bytes] = [*request.block_hashes, *request.block_keys]
        if request.block_hashes and request.block_keys:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give block_hashes or block_keys, not both")
        try:
            query = RouteQuery(namespace_of(request.namespace), list(request.token_ids), hashes, request.tokens,
                               list(request.candidates), request.cache_salt, request.lora_name)
            answer = self._router.route(query)
        except RouteError as exc:
            await context.abort(_STATUS.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT), str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return answer_message(answer)

    async def Report(self, request: router_pb2.ReportRequest, context: grpc.aio.ServicerContext) -> Any:
        if not request.node:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node must not be empty")
        prefills = []
        for i, p in enumerate(request.prefills):
            if not 0 <= p.cached_tokens < p.tokens or not p.seconds > 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prefills[{i}] needs tokens > cached_tokens >= 0 and seconds > 0")
            prefills.append(Prefill(p.model or "default", p.tokens, p.cached_tokens, p.seconds))
        if request.has_queue and not request.queued_prefill_s >= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "queued_prefill_s must not be negative")
        self._report(Report(request.node, request.queued_prefill_s if request.has_queue else None, tuple(prefills)))
        return router_pb2.ReportResponse()


class IndexerServicer(indexer_pb2_grpc.IndexerServiceServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def GetPodScores(self, request: indexer_pb2.GetPodScoresRequest,
                           context: grpc.aio.ServicerContext) -> Any:
        try:
            tokens = [int(t) for t in request.prompt.replace(",", " ").split()]
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt must be token ids separated by spaces or commas (this scorer has no tokenizer)")
        pods = list(request.pod_identifiers)
        try:
            _, _, _, breakdowns = self._router.estimate(RouteQuery(Namespace(model=request.model_name or "default"),
                                                                   token_ids=tokens))
        except RouteError as exc:
            if exc.reason != "no_candidate":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            breakdowns = []
        ttft = {b.node: b.ttft_s for b in breakdowns}
        best = min(ttft.values(), default=0.0)
        scores = {pod: (best / ttft[pod] if ttft.get(pod) else 1.0) if pod in ttft else 0.0
                  for pod in (pods or sorted(ttft))}
        return indexer_pb2.GetPodScoresResponse(scores=[indexer_pb2.PodScore(pod=p, score=s)
                                                        for p, s in scores.items()])


def add_servicers(server: grpc.aio.Server, router: Router, report: Any) -> None:
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router, report), server)
    indexer_pb2_grpc.add_IndexerServiceServicer_to_server(IndexerServicer(router), server)
