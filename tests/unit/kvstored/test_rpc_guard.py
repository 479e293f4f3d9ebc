"""Client mistakes: counted every time, logged once per client and kind per interval."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from clock import Clock

from kvstored.rpc_guard import BadRequests, RequestGuard, _client
from kvstored_client.contract.proto import kvstored_pb2 as pb


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvstored.rpc_guard"]


def count(bad: BadRequests, method: str, kind: str) -> float:
    return bad.counter.labels(method, kind)._value.get()   # type: ignore[no-any-return]


def test_one_line_per_client_and_kind_per_interval_the_rest_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    bad = BadRequests(interval_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, "kvstored.rpc_guard"):
        for _ in range(1000):
            bad.record("Lookup", "malformed_request", "ipv4:10.0.0.1:5000", "Wire format was corrupt")
        bad.record("Lookup", "bad_keys", "ipv4:10.0.0.1:5000", "has 3 bytes")
        bad.record("Seal", "malformed_request", "ipv4:10.0.0.2:6000", "Wire format was corrupt")
        assert len(lines(caplog)) == 3
        clock.now += 59.0
        bad.record("Reserve", "malformed_request", "ipv4:10.0.0.1:5000", "again")
        assert len(lines(caplog)) == 3
        clock.now += 1.0
        bad.record("Reserve", "malformed_request", "ipv4:10.0.0.1:5000", "again")
    logged = lines(caplog)
    assert len(logged) == 4
    assert "1000 more like it" in logged[-1] and "Reserve" in logged[-1]
    assert not any(r.exc_info for r in caplog.records)
    assert count(bad, "Lookup", "malformed_request") == 1000
    assert count(bad, "Reserve", "malformed_request") == 2
    assert count(bad, "Seal", "malformed_request") == 1


def test_a_long_detail_is_cut_and_many_clients_do_not_grow_the_log_or_memory(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    bad = BadRequests(interval_s=60.0, clock=clock, max_clients=10)
    with caplog.at_level(logging.INFO, "kvstored.rpc_guard"):
        bad.record("OpenNamespace", "invalid_argument", "c", "x" * 100_000)
        for port in range(1000):
            bad.record("Lookup", "malformed_request", f"ipv4:10.0.0.1:{port}", "corrupt")
    logged = lines(caplog)
    assert len(logged[0]) < 400
    assert len(logged) == 10
    assert len(bad._windows) == 10
    assert count(bad, "Lookup", "malformed_request") == 1000


def test_what_the_client_sent_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    bad = BadRequests(clock=Clock())
    with caplog.at_level(logging.INFO, "kvstored.rpc_guard"):
        bad.record("OpenNamespace", "invalid_argument", "c", "unknown model 'x\n2026-01-01 ERROR kvstored: forged'")
    (line,) = lines(caplog)
    assert "\n" not in line


def test_a_client_is_its_address_not_its_connection() -> None:
    assert _client("ipv4:10.0.0.1:5555") == _client("ipv4:10.0.0.1:6666") == "ipv4:10.0.0.1"
    assert _client("ipv6:[::1]:5555") == "ipv6:[::1]"
    assert _client("unix:/run/kvstored.sock") == "unix:/run/kvstored.sock"


def test_the_guard_refuses_what_does_not_parse_and_leaves_the_daemons_own_bugs_loud(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In process, on a server with a unary method that parses, one that is a bug (raises), and a
    bidirectional stream: bytes that do not parse are INVALID_ARGUMENT on both, counted, no
    traceback; the bug stays UNKNOWN with its traceback."""
    sock = f"unix:{tmp_path}/g.sock"

    async def echo(request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsRequest:
        return request

    async def bug(request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsRequest:
        raise RuntimeError("the daemon's own bug")

    async def chat(requests: object, context: grpc.aio.ServicerContext) -> None:
        while (msg := await context.read()) is not grpc.aio.EOF:
            await context.write(msg)

    parse, dump = pb.StatsRequest.FromString, pb.StatsRequest.SerializeToString
    handlers = grpc.method_handlers_generic_handler("t.T", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, parse, dump),
        "Bug": grpc.unary_unary_rpc_method_handler(bug, parse, dump),
        "Chat": grpc.stream_stream_rpc_method_handler(chat, parse, dump)})
    bad = BadRequests(clock=Clock())

    async def main() -> list[grpc.StatusCode | None]:
        server = grpc.aio.server(interceptors=[RequestGuard(bad)])
        server.add_generic_rpc_handlers((handlers,))
        server.add_insecure_port(sock)
        await server.start()
        codes: list[grpc.StatusCode | None] = []
        try:
            async with grpc.aio.insecure_channel(sock) as ch:
                assert await ch.unary_unary("/t.T/Echo")(b"", timeout=5) == b""
                for method, body in (("Echo", b"\xff\xff"), ("Bug", b"")):
                    try:
                        await ch.unary_unary(f"/t.T/{method}")(body, timeout=5)
                        codes.append(None)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                call = ch.stream_stream("/t.T/Chat")()
                await call.write(b"")
                assert await call.read() == b""
                await call.write(b"\xff\xff")
                codes.append(await call.code())
        finally:
            await server.stop(None)
        return codes

    with caplog.at_level(logging.INFO):
        assert asyncio.run(main()) == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN,
                                       grpc.StatusCode.INVALID_ARGUMENT]
    assert count(bad, "Echo", "malformed_request") == 1 and count(bad, "Chat", "malformed_request") == 1
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "the daemon's own bug" in repr(tracebacks[0].exc_info)
