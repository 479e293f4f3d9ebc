"""Hostile input on every listener: a documented status (or a closed connection), a daemon that
keeps serving, a log of bounded size without tracebacks, and nothing left behind.

Seeded: the seed is printed (``pytest -s``, or shown with a failure); ``KVSTORED_FUZZ_SEED=N``
repeats a run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import zmq
from google.protobuf.descriptor import MethodDescriptor
from loopback import free_ports

import kvstored
from conftest import ROOT, Daemon
from kvstored.peers import wire
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc
from router_proc import RouterProc, events_args, source
from tools import fuzz

Factory = Callable[..., Daemon]   # conftest's daemon_factory: daemons stopped at the test's end, whatever happens
LOG_BOUND_BYTES = 64 << 10   # a traceback per request would be megabytes
PER_KIND = 4                 # requests of each kind to each method (one for the huge kind)


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("KVSTORED_FUZZ_SEED", time.time_ns() % (1 << 32)))
    print(f"fuzz seed {value} (KVSTORED_FUZZ_SEED={value} repeats this run)")
    return value


def serving(d: Daemon) -> dict[str, Any]:
    """The daemon's stats, as a well-behaved client sees them (fails if it stopped serving)."""
    assert d.proc.poll() is None, f"kvstored exited with {d.proc.returncode}:\n{d.log()[-3000:]}"
    with kvstored.Client(d.socket) as c:
        return c.stats()


def quiet_log(d: Daemon) -> None:
    log = d.log()
    assert "Traceback" not in log, log[-5000:]
    assert len(log) < LOG_BOUND_BYTES, f"{len(log)} bytes of log:\n{log[-3000:]}"


def test_every_kvstore_method_answers_hostile_requests_with_a_documented_status(
        tmp_path: Path, seed: int, daemon_factory: Factory) -> None:
    """Random bytes, truncated messages, huge repeated fields, wrong-length hashes and other
    sessions' ids, on every method of the proto (a new RPC is covered without a change here)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    d = daemon_factory("--set", "log.level=info", "--set", f"dram.shm_dir={shm}")
    documented = fuzz.documented_statuses((ROOT / "README.md").read_text())
    rng = random.Random(seed)
    owner, victim_ids = fuzz.victim(d.socket)
    own = kvstored.Client(d.socket)
    ids = fuzz.Ids(own._session(), victim_ids.namespace, victim_ids.victim_session, victim_ids.victim_leases)
    requests = fuzz.Requests(rng, ids)
    report = fuzz.Report(seed)
    try:
        with grpc.insecure_channel(f"unix:{d.socket}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            for method in fuzz.methods():
                for kind in fuzz.KINDS:
                    for _ in range(1 if kind == "huge" else PER_KIND):
                        report.add(fuzz.fire(ch, requests.make(method, kind), 10.0), documented)
                serving(d)
        assert report.ok, report.text()
        assert set(report.by_method) == {m.name for m in fuzz.methods()}
        # the well-behaved client that owned the ids the hostile one sent still works
        assert owner.stats()["clients"] >= 1
    finally:
        own.close()
        owner.close()
    stats = serving(d)
    assert stats["clients"] == 0 and stats["active_leases"] == 0, stats
    assert d.stop() == 0
    quiet_log(d)
    assert list(shm.iterdir()) == [], "shared-memory files left behind"
    assert not Path(d.socket).exists()


def _peer_daemon(daemon_factory: Factory, *extra: str) -> tuple[Daemon, int]:
    (port,) = free_ports(1)
    d = daemon_factory("--set", "log.level=info", "--set", f"peers.listen=127.0.0.1:{port}",
                     "--set", "peers.node_id=a", "--set", "peers.token=t0ken", *extra)
    return d, port


def _exchange(port: int, data: bytes, linger_s: float = 0.2) -> bytes:
    """Send ``data`` on a fresh connection and read what comes back until the daemon closes it
    or ``linger_s`` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        s.settimeout(linger_s)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
                if len(got) > 1 << 20:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def _hello(token: bytes = b"t0ken") -> bytes:
    return wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, len(token)) + token


def _peer_garbage(rng: random.Random) -> Iterator[bytes]:
    for _ in range(20):
        yield rng.randbytes(rng.choice((1, 7, 8, 64, 4096)))
    for _ in range(20):
        yield _hello(b"wrong")
    yield _hello()[:5]                                                     # a truncated HELLO
    yield wire.HELLO.pack(b"KVPB", 99, 0xFF, 0)                            # a version from the future
    for _ in range(20):
        op = rng.choice((wire.OP_FETCH, wire.OP_PUSH, wire.OP_LOOKUP, wire.OP_NAMESPACE, 0, 255))
        keys, body = rng.choice(((1, 33), (0xFFFFFFFF, 0), (3, 0xFFFFFFFF), (2, 10), (0, 0)))
        request = wire.REQUEST.pack(op, rng.randrange(256), 0, keys, rng.getrandbits(64), body)
        payload = rng.randbytes(rng.choice((0, 5, 64)))
        cut = rng.randrange(len(request) + len(payload) + 1)
        yield _hello() + (request + payload)[:cut]                          # whole, or cut anywhere
    frame = wire.FRAME.pack(wire.BLOCK, 32, 0, 0, 1 << 62, 0)              # a frame claiming 4 EiB
    yield _hello() + wire.REQUEST.pack(wire.OP_PUSH, 0, 0, 1, 1, 33) + b"\x20" + bytes(32) + frame


def test_the_peer_port_survives_garbage_truncated_frames_and_stalled_peers(seed: int, daemon_factory: Factory) -> None:
    d, port = _peer_daemon(daemon_factory)
    rng = random.Random(seed)
    before = serving(d)
    for data in _peer_garbage(rng):
        _exchange(port, data)
    serving(d)
    # peers that stall mid-frame, and idle ones, hold nothing a well-behaved client needs
    stalled = []
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall([b"", _hello(), _hello()[:3], _hello() + wire.REQUEST.pack(wire.OP_FETCH, 0, 0, 1, 1, 33)[:9]][i % 4])
        stalled.append(s)
    try:
        assert serving(d)["namespaces"] == before["namespaces"]
        assert _exchange(port, _hello(), linger_s=1.0)[:4] == wire.MAGIC   # a new peer is still welcomed
    finally:
        for s in stalled:
            s.close()
    serving(d)
    assert d.stop() == 0
    quiet_log(d)
    assert d.log().count("wrong_token") == 1   # twenty tries, one line a minute


def http_error(reply: bytes) -> bool:
    """A 4xx answer (as HTTP/0.9 when the request line was not HTTP's: no status line), or none."""
    return reply == b"" or reply.startswith((b"HTTP/1.0 4", b"HTTP/1.1 4")) or b"Error code: 4" in reply


def test_the_metrics_port_answers_garbage_with_http_errors(seed: int, daemon_factory: Factory) -> None:
    (port,) = free_ports(1)
    d = daemon_factory("--set", "log.level=info", "--set", f"server.metrics=127.0.0.1:{port}")
    rng = random.Random(seed)
    for _ in range(20):
        reply = _exchange(port, rng.randbytes(rng.choice((1, 16, 1024))) + b"\r\n\r\n")
        assert http_error(reply), reply[:200]
    for path in ("/metrics/../../etc/passwd", "/%00", "/" + "x" * 70000, "/metrics?" + "a=b&" * 1000):
        reply = _exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), linger_s=1.0)
        assert http_error(reply) or reply.startswith(b"HTTP/1.0 200"), reply[:200]
    reply = _exchange(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\nabc")
    assert reply == b"" or reply.startswith(b"HTTP/"), reply[:200]
    stalled = socket.create_connection(("127.0.0.1", port), timeout=5)
    stalled.sendall(b"GET /metr")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert b"kvstored_uptime_seconds" in resp.read()
    finally:
        stalled.close()
    serving(d)
    assert d.stop() == 0
    quiet_log(d)


def _router_methods() -> list[MethodDescriptor]:
    from kvstored.router.proto import indexer_pb2, router_pb2
    return [m for module in (router_pb2, indexer_pb2) for service in module.DESCRIPTOR.services_by_name.values()
            for m in service.methods]


def _http(port: int, method: str, path: str, body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return _exchange(port, head.encode() + body, linger_s=2.0)


def _json_garbage(rng: random.Random) -> bytes:
    values: list[object] = [None, True, -1, 2**70, 1e308, "", "x" * 1000, [], {}, [1] * 10000, {"a": [[[[]]]]},
                            "deadbeef", ["zz"], [2**64]]
    fields = ["namespace", "token_ids", "block_hashes", "tokens", "candidates", "cache_salt", "lora_name",
              "node", "queued_prefill_s", "prefills", "model", "cached_tokens", "seconds", "bogus"]
    obj = {rng.choice(fields): rng.choice(values) for _ in range(rng.randint(0, 5))}
    if rng.random() < 0.3:
        obj["prefills"] = [{f: rng.choice(values) for f in ("model", "tokens", "cached_tokens", "seconds")}]
    raw = json.dumps(obj).encode()
    return raw[:rng.randrange(len(raw) + 1)] if rng.random() < 0.3 else raw


def test_the_event_replay_socket_and_the_routers_apis_survive_hostile_input(
        tmp_path: Path, seed: int, daemon_factory: Factory) -> None:
    rng = random.Random(seed)
    (grpc_port,) = free_ports(1)
    d = daemon_factory(*events_args(tmp_path, "a"), "--set", "log.level=info")
    router = RouterProc(tmp_path, [source(tmp_path, "a")], "--set", f"router.grpc=127.0.0.1:{grpc_port}",
                        "--set", "log.level=info")
    try:
        # the replay socket: random frames from a ZMQ peer, and bytes that are not ZMTP at all
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{tmp_path}/a.replay")
        try:
            for _ in range(50):
                dealer.send_multipart([rng.randbytes(rng.choice((0, 1, 8, 9, 100))) for _ in range(rng.randint(1, 4))])
            replay = str(tmp_path / "a.replay")
            for _ in range(20):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                    raw.connect(replay)
                    raw.sendall(rng.randbytes(rng.choice((1, 10, 64, 4096))))
            replies = 0
            while dealer.poll(2000):   # each request is answered (a replay's end at least), none kills it
                dealer.recv_multipart()
                replies += 1
            assert replies >= 1
        finally:
            dealer.close(0)
            ctx.term()
        # the router's gRPC services: every method from the descriptors, hostile bodies
        report = fuzz.Report(seed)
        requests = fuzz.Requests(rng, fuzz.Ids())
        # (RESOURCE_EXHAUSTED: gRPC's own, for a huge message past the router's 4 MiB default)
        allowed = frozenset({"OK", "INVALID_ARGUMENT", "UNAVAILABLE", "RESOURCE_EXHAUSTED"})
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            for method in _router_methods():
                for kind in fuzz.KINDS:
                    for _ in range(1 if kind == "huge" else 5):
                        report.add(fuzz.fire(ch, requests.make(method, kind), 10.0), {method.name: allowed})
        assert report.ok, report.text()
        # the router's HTTP API: JSON that is not what it expects, bodies cut short, garbage
        for _ in range(60):
            path = rng.choice(("/v1/route", "/v1/report", "/v1/nodes", "/healthz", "/nope", "/v1/route?x=" + "y" * 100))
            reply = _http(router.port, rng.choice(("POST", "GET", "PUT")), path, _json_garbage(rng))
            assert http_error(reply) or reply.startswith(b"HTTP/1.1 200"), reply[:300]
        for data in (rng.randbytes(5000), b"POST /v1/route HTTP/1.1\r\nContent-Length: 10\r\n\r\n{",
                     b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
                     b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\n\r\n"):
            assert http_error(_exchange(router.port, data, linger_s=1.0))
        assert router.get("/healthz") is not None and router.proc.poll() is None
    finally:
        router.stop()
        d.stop()
    for log in (router.log(), d.log()):
        assert "Traceback" not in log, log[-5000:]
        assert len(log) < LOG_BOUND_BYTES, log[-3000:]


def test_abandoned_sessions_double_release_and_seal_oversized_messages_and_many_namespaces(
        daemon_factory: Factory) -> None:
    """The cases a first user tried by hand, kept: each refused with its status, nothing left held."""
    d = daemon_factory("--set", "log.level=info")
    with kvstored.Client(d.socket) as c:
        c.save(list(range(64)), np.ones((4, 512), np.uint8))
        ns, session, stub = c._ns(None)[0], c._session(), c._stub
        keys = pb.BlockKeys(token_ids=list(range(64)))
        lease = stub.Lookup(pb.LookupRequest(namespace_id=ns, keys=keys, lease=True, session_id=session)).lease_id
        with kvstored.Client(d.socket) as other:   # another session cannot release it
            with pytest.raises(grpc.RpcError) as info:
                stub.Release(pb.ReleaseRequest(session_id=other._session(), lease_id=lease), timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Release(pb.ReleaseRequest(session_id=session, lease_id=lease), timeout=10)
        with pytest.raises(grpc.RpcError) as info:   # released twice
            stub.Release(pb.ReleaseRequest(session_id=session, lease_id=lease), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        fresh = pb.BlockKeys(token_ids=list(range(1000, 1064)))
        reservation = stub.Reserve(pb.ReserveRequest(session_id=session, namespace_id=ns, keys=fresh,
                                                     block_bytes=512), timeout=10).reservation_id
        stub.Seal(pb.SealRequest(session_id=session, reservation_id=reservation), timeout=10)
        with pytest.raises(grpc.RpcError) as info:   # sealed twice
            stub.Seal(pb.SealRequest(session_id=session, reservation_id=reservation), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(f"unix:{d.socket}", options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as info:   # over the daemon's 64 MiB
            ch.unary_unary("/kvstored.v1.KVStore/Lookup")(bytes(65 << 20), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    before = serving(d)

    async def abandon(n: int) -> int:
        async with grpc.aio.insecure_channel(f"unix:{d.socket}") as ch:
            stub = pb_grpc.KVStoreStub(ch)
            calls = []
            for i in range(n):
                call = stub.Session()
                await call.write(pb.SessionRequest(client_name=f"abandoned-{i}", pid=1))
                await call.read()
                calls.append(call)
            open_now = (await stub.Stats(pb.StatsRequest(), timeout=10)).clients
            for call in calls:   # gone without a word, as a killed engine goes
                call.cancel()
            for i in range(2000):   # the namespaces a client may open, each with its own model
                spec = pb.NamespaceSpec(model=f"m{i}", block_size=16)
                await stub.OpenNamespace(pb.OpenNamespaceRequest(spec=spec), timeout=10)
            return open_now

    assert asyncio.run(abandon(500)) == before["clients"] + 500
    deadline = time.monotonic() + 20
    while (now := serving(d))["clients"] != before["clients"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now["clients"] == before["clients"] and now["active_leases"] == 0
    assert now["namespaces"] == before["namespaces"] + 2000
    assert d.stop() == 0
    log = d.log()
    assert "Traceback" not in log
