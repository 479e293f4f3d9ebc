"""Client.flush against a daemon from before FlushStream (only the unary Flush)."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc

from kvstored_client import Client
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc


class OlderDaemon(pb_grpc.KVStoreServicer):
    """Hello and the unary Flush; FlushStream is UNIMPLEMENTED, as in a daemon before it."""

    def __init__(self) -> None:
        self.flushes: list[str] = []

    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloResponse:
        return pb.HelloResponse(version="0.older")

    def Flush(self, request: pb.FlushRequest, context: grpc.ServicerContext) -> pb.FlushResponse:
        self.flushes.append(request.model)
        return pb.FlushResponse(blocks=7)


def test_flush_against_a_daemon_from_before_flush_stream(tmp_path: Path) -> None:
    """Was: Client.flush() (and flushing()) called only FlushStream, so an SDK upgraded beside a
    daemon from before it raised KVStoreError("Method not found!") where flush() used to work."""
    daemon = OlderDaemon()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVStoreServicer_to_server(daemon, server)
    socket = str(tmp_path / "kvstored.sock")
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    try:
        with Client(socket) as c:
            assert c.flush("m") == 7
            assert list(c.flushing()) == [{"written_blocks": 7, "left_blocks": 0, "done": True}]
        assert daemon.flushes == ["m", ""]
    finally:
        server.stop(None)
