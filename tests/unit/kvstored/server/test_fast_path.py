"""The daemon's fast path on a real Unix socket, in process, over a stand-in servicer: a failure
answered with its status and reason and read back by the SDK as the same error, the deadline a
frame carries honoured in the daemon (the handler cancelled, DEADLINE_EXCEEDED answered), a
closed connection cancelling its calls, refusals counted, and answers paired by request id."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from kvstored.rpc_guard import BadRequests
from kvstored.server.fast_path import FastPath
from kvstored.server.status import mapped
from kvstored_client.contract import frames
from kvstored_client.contract.errors import InvalidArgument, NotFound, Reason
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.errors import from_rpc_error
from kvstored_client.fast_path import FastChannel, FrameCallError


class Servicer:
    """The fast path's methods: Stats answers, Lookup waits until cancelled, Release refuses,
    Prefetch refuses as the client's mistake, the rest answer empty."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    @mapped
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        left = context.time_remaining()
        return pb.StatsResponse(version="test", uptime_s=-1.0 if left is None else left)

    @mapped
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return pb.LookupResponse()

    @mapped
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        raise NotFound(f"no lease {request.lease_id}", Reason.UNKNOWN_LEASE)

    @mapped
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> pb.PrefetchResponse:
        raise InvalidArgument("bad keys", Reason.BAD_KEYS)

    @mapped
    async def Reserve(self, request: Any, context: Any) -> pb.ReserveResponse:
        return pb.ReserveResponse()

    @mapped
    async def Seal(self, request: Any, context: Any) -> pb.SealResponse:
        return pb.SealResponse()

    @mapped
    async def Commit(self, request: Any, context: Any) -> pb.CommitResponse:
        return pb.CommitResponse()

    @mapped
    async def SaveBlocks(self, request: Any, context: Any) -> pb.SaveBlocksResponse:
        return pb.SaveBlocksResponse()

    @mapped
    async def LoadBlocks(self, request: Any, context: Any) -> pb.LoadBlocksResponse:
        return pb.LoadBlocksResponse()


def serve(tmp_path: Path, body: Callable[[str, Servicer, BadRequests], Awaitable[None]]) -> None:
    async def main() -> None:
        servicer = Servicer()
        bad = BadRequests()
        fast = FastPath(servicer, bad)
        path = tmp_path / "kv.fast.sock"
        await fast.start(path, 0o660)
        try:
            await body(str(path), servicer, bad)
        finally:
            fast.close()
    asyncio.run(main())


def raw(path: str, frame: bytes, timeout_s: float = 10.0) -> tuple[int, int, bytes]:
    """Send ``frame`` on a connection of its own; (request id, status code, payload) of the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(frame)
        length, request_id, code = frames.ANSWER.unpack(sock.recv(frames.ANSWER.size, socket.MSG_WAITALL))
        return request_id, code, sock.recv(length, socket.MSG_WAITALL) if length else b""


def request(method: str, message: Any, request_id: int = 7, budget_s: float = 5.0) -> bytes:
    body = message.SerializeToString()
    return frames.REQUEST.pack(len(body), frames.METHOD_IDS[method], request_id, budget_s) + body


def test_answers_failures_with_their_reason_and_the_sdk_reads_the_same_error(tmp_path: Path) -> None:
    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        channel = FastChannel(path)
        try:
            stats = await asyncio.to_thread(channel.call, "Stats", pb.StatsRequest(), pb.StatsResponse, 5.0)
            assert stats.version == "test" and 0 < stats.uptime_s <= 5.0   # the budget reached the handler
            with pytest.raises(FrameCallError) as failed:
                await asyncio.to_thread(channel.call, "Release", pb.ReleaseRequest(lease_id=3), pb.ReleaseResponse,
                                        5.0)
            err = from_rpc_error(failed.value)
            assert type(err) is NotFound and err.reason == Reason.UNKNOWN_LEASE and str(err) == "no lease 3"
            # a refusal that is the client's mistake is counted, as on gRPC
            with pytest.raises(FrameCallError) as refused:
                await asyncio.to_thread(channel.call, "Prefetch", pb.PrefetchRequest(), pb.PrefetchResponse, 5.0)
            assert from_rpc_error(refused.value).reason == Reason.BAD_KEYS
            assert _count(bad, "Prefetch", "bad_keys") == 1
        finally:
            channel.close()
    serve(tmp_path, body)


def test_a_request_that_does_not_parse_is_refused_as_malformed_and_counted(tmp_path: Path) -> None:
    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        garbage = b"\xff\xff\xff"
        frame = frames.REQUEST.pack(len(garbage), frames.METHOD_IDS["Lookup"], 9, 5.0) + garbage
        request_id, code, payload = await asyncio.to_thread(raw, path, frame)
        status = status_pb2.Status.FromString(payload)
        assert request_id == 9 and code == status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert _count(bad, "Lookup", "malformed_request") == 1
        # an unknown method: UNIMPLEMENTED, as gRPC answers one (not counted: no mistake of the request's)
        unknown = frames.REQUEST.pack(0, 100, 10, 5.0)
        assert (await asyncio.to_thread(raw, path, unknown))[:2] == (10, grpc.StatusCode.UNIMPLEMENTED.value[0])
    serve(tmp_path, body)


def test_a_one_way_frame_is_served_and_never_answered(tmp_path: Path) -> None:
    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        body_ = pb.PrefetchRequest().SerializeToString()
        one_way = frames.REQUEST.pack(len(body_), frames.METHOD_IDS["Prefetch"] | frames.ONE_WAY, 1, 5.0) + body_
        unknown = frames.REQUEST.pack(0, 100 | frames.ONE_WAY, 2, 5.0)   # not even UNIMPLEMENTED
        # the first answer on the connection is the call after them
        stats = request("Stats", pb.StatsRequest(), 3)
        request_id, code, _ = await asyncio.to_thread(raw, path, one_way + unknown + stats)
        assert (request_id, code) == (3, frames.OK)
        assert _count(bad, "Prefetch", "bad_keys") == 1   # served: refused, and counted, as any call
    serve(tmp_path, body)


def test_the_deadline_a_frame_carries_cancels_the_handler_and_answers_deadline_exceeded(tmp_path: Path) -> None:
    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        request_id, code, payload = await asyncio.to_thread(raw, path, request("Lookup", pb.LookupRequest(),
                                                                               budget_s=0.2))
        assert request_id == 7 and code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert servicer.cancelled.is_set()
        assert status_pb2.Status.FromString(payload).code == code
    serve(tmp_path, body)


def test_a_closed_connection_cancels_its_calls_in_flight(tmp_path: Path) -> None:
    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            sock.sendall(request("Lookup", pb.LookupRequest(), budget_s=0.0))   # no deadline
            await asyncio.sleep(0.1)
        await asyncio.wait_for(servicer.cancelled.wait(), 10)
    serve(tmp_path, body)


def test_answers_on_one_connection_are_paired_by_request_id(tmp_path: Path) -> None:
    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        def pipelined() -> list[int]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(path)
                # the first waits for its deadline, the second answers at once: out of order
                sock.sendall(request("Lookup", pb.LookupRequest(), 1, 0.3) + request("Stats", pb.StatsRequest(), 2))
                ids = []
                for _ in range(2):
                    length, request_id, _ = frames.ANSWER.unpack(sock.recv(frames.ANSWER.size, socket.MSG_WAITALL))
                    sock.recv(length, socket.MSG_WAITALL)
                    ids.append(request_id)
                return ids
        assert await asyncio.to_thread(pipelined) == [2, 1]
    serve(tmp_path, body)


def test_a_frame_over_the_limit_or_with_a_bad_budget_ends_its_connection(tmp_path: Path) -> None:
    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        def ended(frame: bytes) -> bool:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(path)
                sock.sendall(frame)
                return sock.recv(1) == b""
        assert await asyncio.to_thread(ended, frames.REQUEST.pack(frames.MAX_PAYLOAD_BYTES + 1, 1, 1, 1.0))
        assert await asyncio.to_thread(ended, frames.REQUEST.pack(0, 8, 1, float("nan")))
        assert _count(bad, "(frame)", "malformed_frame") == 2
    serve(tmp_path, body)


def _count(bad: BadRequests, method: str, kind: str) -> float:
    for metric in bad.counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels == {"method": method, "kind": kind}:
                return sample.value
    return 0.0


def test_a_client_that_sends_many_calls_before_reading_gets_every_answer(tmp_path: Path) -> None:
    """Reading pauses while a connection's answers wait to be read (and while 64 of its calls run),
    and resumes as they are read: nothing is lost or stuck on the way."""
    calls = 20_000   # answers of ~40 bytes: far more than the socket's and the transport's buffers

    async def body(path: str, servicer: Servicer, bad: BadRequests) -> None:
        def flood() -> list[int]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30)
                sock.connect(path)
                sender = threading.Thread(target=sock.sendall, args=(b"".join(
                    request("Stats", pb.StatsRequest(), i + 1) for i in range(calls)),))
                sender.start()
                sender.join(1.0)   # blocked once the daemon stops reading: the answers are not read yet
                ids = []
                for _ in range(calls):
                    length, request_id, code = frames.ANSWER.unpack(sock.recv(frames.ANSWER.size, socket.MSG_WAITALL))
                    sock.recv(length, socket.MSG_WAITALL)
                    assert code == frames.OK
                    ids.append(request_id)
                sender.join(30)
                return ids
        assert sorted(await asyncio.to_thread(flood)) == list(range(1, calls + 1))
    serve(tmp_path, body)
