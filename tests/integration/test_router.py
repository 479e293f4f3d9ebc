"""The router against real daemons publishing KV events: routing to the node that holds a
prompt, and the faults of issue 29 (a daemon killed and restarted, a subscriber behind the
publisher's buffer, a router restarted, bad input to every API)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import numpy as np
import pytest

import kvstored
from conftest import Daemon, start_daemon
from router_proc import RouterProc, events_args, source

BLOCK = 4096
MODEL = "m-route"
# Blocks of 4 KiB cross a 5 GB/s peer link in no time, so any node could pull a prompt another
# holds and all would be near-equal (chosen at random): a slow link makes the holder win.
SLOW_PEERS = ("--set", "router.peer_bytes_per_s=1000")


def save(daemon: Daemon, tokens: list[int]) -> None:
    with kvstored.Client(daemon.socket, namespace=kvstored.Namespace(model=MODEL)) as client:
        client.save(np.array(tokens), np.ones((len(tokens) // 16, BLOCK), np.uint8))


def route(router: RouterProc, tokens: list[int]) -> dict[str, object]:
    status, answer = router.post("/v1/route", {"model": MODEL, "token_ids": tokens})
    assert status == 200, answer
    return answer   # type: ignore[no-any-return]


def local(answer: dict[str, object]) -> dict[str, int]:
    return {c["node"]: c["local_blocks"] for c in answer["candidates"]}   # type: ignore[attr-defined]


def test_a_killed_daemon_is_dropped_and_its_restart_relearned_under_a_new_epoch(tmp_path: Path) -> None:
    a = start_daemon(tmp_path / "a", *events_args(tmp_path, "a"))
    b = start_daemon(tmp_path / "b", *events_args(tmp_path, "b"))
    # a slow prefill (1e12 FLOP/s): recomputing 640 tokens of an 8B model costs seconds, so the
    # node holding them wins clearly, not as one of two near-equal choices
    router = RouterProc(tmp_path, [source(tmp_path, "a"), source(tmp_path, "b")],
                        "--set", "router.prefill_flops_per_s=1e12", *SLOW_PEERS)
    try:
        router.wait(lambda n: n["available"] == ["a", "b"])
        long, short = list(range(16 * 40)), list(range(100_000, 100_000 + 16 * 8))
        save(a, long)
        save(b, short)
        router.wait(lambda n: n["index_entries"] == 48)
        answer = route(router, long)
        assert answer["node"] == "a" and local(answer) == {"a": 40, "b": 0}
        with kvstored.Client(a.socket, namespace=kvstored.Namespace(model=MODEL)) as client:
            client.flush()
            client.evict(tier="dram")   # on disk only, now: what a restart brings back
            client.save(np.array(short), np.ones((8, BLOCK), np.uint8))   # and these in DRAM only
        router.wait(lambda n: n["index_entries"] == 56)
        epoch = next(n["epoch"] for n in router.get("/v1/nodes")["nodes"] if n["node"] == "a")
        a.stop(signal.SIGKILL)
        nodes = router.wait(lambda n: n["available"] == ["b"])
        assert nodes["index_entries"] == 8   # a's entries went with it
        answer = route(router, long)
        assert answer["node"] == "b" and local(answer) == {"b": 0}
        a = start_daemon(tmp_path / "a", *events_args(tmp_path, "a"))
        nodes = router.wait(lambda n: n["available"] == ["a", "b"] and n["index_entries"] == 48)
        assert next(n["epoch"] for n in nodes["nodes"] if n["node"] == "a") != epoch
        # b counts as holding the prompt just sent there (until its events say so); a holds it on SSD
        assert local(route(router, long)) == {"a": 40, "b": 40}
        assert local(route(router, short)) == {"a": 0, "b": 8}   # a's DRAM-only blocks died with it
    finally:
        router.stop()
        a.stop()
        b.stop()


def test_a_subscriber_behind_the_publishers_buffer_rebuilds_from_a_snapshot(tmp_path: Path) -> None:
    a = start_daemon(tmp_path / "a", *events_args(tmp_path, "a", "--set", "events.buffer_steps=2"))
    try:
        prompts = [list(range(i * 1000, i * 1000 + 16 * 4)) for i in range(6)]
        for p in prompts:
            save(a, p)
        with kvstored.Client(a.socket, namespace=kvstored.Namespace(model=MODEL)) as client:
            client.flush()
            client.evict(tier="dram")
        router = RouterProc(tmp_path, [source(tmp_path, "a")])
        try:
            nodes = router.wait(lambda n: n["available"] == ["a"] and n["index_entries"] == 24)
            assert nodes["nodes"][0]["snapshots"] == 1 and nodes["nodes"][0]["replays"] == 0
            answer = route(router, prompts[0])
            ssd = answer["candidates"][0]
            assert ssd["local_blocks"] == 4
        finally:
            router.stop()
    finally:
        a.stop()


def test_a_restarted_router_rebuilds_its_index_from_replay(tmp_path: Path) -> None:
    a = start_daemon(tmp_path / "a", *events_args(tmp_path, "a"))
    try:
        prompt = list(range(16 * 12))
        save(a, prompt)
        for _ in range(2):
            router = RouterProc(tmp_path, [source(tmp_path, "a")])
            try:
                nodes = router.wait(lambda n: n["available"] == ["a"] and n["index_entries"] == 12)
                assert nodes["nodes"][0]["replays"] == 1
                assert local(route(router, prompt)) == {"a": 12}
            finally:
                assert router.stop() == 0, router.log()
    finally:
        a.stop()


BAD_ROUTES = [
    b"not json", b"[1, 2]", b'{"model": "m"}', b'{"model": "m", "token_ids": "abc"}',
    b'{"model": "m", "token_ids": [1, 2], "block_hashes": [1]}', b'{"model": "", "token_ids": [1]}',
    b'{"model": "m", "block_hashes": ["zz"]}', b'{"model": "m", "block_hashes": [18446744073709551616]}',
    b'{"model": "m", "block_hashes": [1], "tokens": -1}', b'{"model": "m", "token_ids": [-5]}',
    b'{"model": "m", "token_ids": [1], "bogus": 1}', b'{"model": "m", "namespace": {"block_size": 0}, "token_ids": []}',
    b'{"model": "m", "block_hashes": [1, 2], "tokens": 3}', b'{"model": "m", "token_ids": [1], "candidates": [7]}',
]
BAD_REPORTS = [b'{}', b'{"node": "a", "queued_prefill_s": -1}', b'{"node": "a", "prefills": [{"tokens": 1}]}',
               b'{"node": "a", "prefills": [{"tokens": 10, "cached_tokens": 10, "seconds": 1}]}', b'"x"']


def test_bad_input_to_every_api_gets_a_clear_error_and_the_router_keeps_serving(tmp_path: Path) -> None:
    a = start_daemon(tmp_path / "a", *events_args(tmp_path, "a"))
    router = RouterProc(tmp_path, [source(tmp_path, "a")])
    try:
        router.wait(lambda n: n["available"] == ["a"])
        for body in BAD_ROUTES:
            status, answer = router.request("POST", "/v1/route", body)
            assert status == 400 and answer["reason"] == "invalid_argument" and answer["error"], (body, answer)
        for body in BAD_REPORTS:
            status, answer = router.request("POST", "/v1/report", body)
            assert status == 400 and answer["error"], (body, answer)
        status, answer = router.post("/v1/route", {"model": MODEL, "token_ids": [1] * 32, "candidates": ["nope"]})
        assert status == 503 and answer["reason"] == "no_candidate"
        assert router.request("GET", "/v1/route")[0] == 405
        assert router.request("GET", "/nowhere")[0] == 404
        for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/route HTTP/1.1\r\n\r\n",
                    b"POST /v1/route HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
                    b"POST /v1/route HTTP/1.1\r\nContent-Length: 10\r\n\r\n{\"a\""):
            with socket.create_connection(("127.0.0.1", router.port), timeout=5) as conn:
                conn.sendall(raw)
                conn.shutdown(socket.SHUT_WR)
                reply = conn.recv(4096)
                assert reply == b"" or reply.startswith(b"HTTP/1.1 4"), (raw, reply)
        assert router.post("/v1/report", {"node": "a", "queued_prefill_s": 0.5,
                                          "prefills": [{"model": MODEL, "tokens": 512, "seconds": 0.1}]})[0] == 200
        assert route(router, list(range(64)))["node"] == "a"   # still serving
        assert router.proc.poll() is None
    finally:
        router.stop()
        a.stop()


@pytest.mark.parametrize("flag", ["router.listen=0.0.0.0:8300", "router.sources=a", "router.spread=2"])
def test_bad_router_settings_are_refused_naming_the_key(flag: str) -> None:
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "kvstored.router.main", "--no-config", "--set", flag],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and flag.split("=")[0] in proc.stderr, proc.stderr


def test_kvctl_route_prints_each_candidates_breakdown(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys
    a = start_daemon(tmp_path / "a", *events_args(tmp_path, "a"))
    b = start_daemon(tmp_path / "b", *events_args(tmp_path, "b"))
    router = RouterProc(tmp_path, [source(tmp_path, "a"), source(tmp_path, "b")], "--set",
                        "router.prefill_flops_per_s=1e12", *SLOW_PEERS)
    try:
        prompt = list(range(16 * 20))
        save(b, prompt)
        router.wait(lambda n: n["available"] == ["a", "b"] and n["index_entries"] == 20)
        (tmp_path / "prompt.txt").write_text(" ".join(map(str, prompt)))
        url = f"http://127.0.0.1:{router.port}"
        kvctl = [sys.executable, "-m", "kvstored.kvctl", "route", str(tmp_path / "prompt.txt"), "--router", url,
                 "--model", MODEL]
        out = subprocess.run([*kvctl, "--json"], capture_output=True, text=True, timeout=60)
        answer = json.loads(out.stdout)
        assert answer["node"] == "b", answer
        assert {c["node"]: c["local_blocks"] for c in answer["candidates"]} == {"a": 0, "b": 20}
        # the route just made is b's queue now: a may win by pulling b's blocks (a costed option)
        out = subprocess.run(kvctl, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "route: " in out.stdout and " * " in out.stdout and "TTFT ms" in out.stdout, out.stdout
        assert out.stdout.count("\n│ a") + out.stdout.count("\n│ b") == 2, out.stdout
        (tmp_path / "bad.txt").write_text("one two")
        out = subprocess.run([*kvctl[:4], str(tmp_path / "bad.txt"), "--router", url], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and "token ids" in out.stderr
        out = subprocess.run([*kvctl[:5], "--router", "http://127.0.0.1:1"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 1 and "cannot reach the router" in out.stderr
    finally:
        router.stop()
        a.stop()
        b.stop()


def test_grpc_route_report_and_llm_d_pod_scores(tmp_path: Path) -> None:
    import grpc
    from loopback import free_ports

    from kvstored.router.proto import indexer_pb2, indexer_pb2_grpc, router_pb2, router_pb2_grpc

    port = free_ports(1)[0]
    a = start_daemon(tmp_path / "a", *events_args(tmp_path, "a"))
    b = start_daemon(tmp_path / "b", *events_args(tmp_path, "b"))
    router = RouterProc(tmp_path, [source(tmp_path, "a"), source(tmp_path, "b")], "--set",
                        f"router.grpc=127.0.0.1:{port}", "--set", "router.prefill_flops_per_s=1e12", *SLOW_PEERS)
    try:
        prompt = list(range(16 * 24))
        save(a, prompt)
        router.wait(lambda n: n["available"] == ["a", "b"] and n["index_entries"] == 24)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            ns = router_pb2.RouteNamespace(model=MODEL)
            answer = stub.Route(router_pb2.RouteRequest(namespace=ns, token_ids=prompt), timeout=10)
            assert answer.node == "a" and {c.node: c.local_blocks for c in answer.candidates} == {"a": 24, "b": 0}
            hashes = [int.from_bytes(h[-8:], "big") for h in kvstored.block_hashes(prompt)]
            by_hash = stub.Route(router_pb2.RouteRequest(namespace=ns, block_hashes=hashes), timeout=10)
            assert {c.node: c.local_blocks for c in by_hash.candidates} == {"a": 24, "b": 0}
            for bad in (router_pb2.RouteRequest(namespace=ns),
                        router_pb2.RouteRequest(namespace=router_pb2.RouteNamespace(model=MODEL, block_size=9999),
                                                token_ids=prompt),
                        router_pb2.RouteRequest(namespace=ns, block_hashes=[1], block_keys=[b"x" * 32])):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Route(bad, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            with pytest.raises(grpc.RpcError) as err:
                stub.Route(router_pb2.RouteRequest(namespace=ns, token_ids=prompt, candidates=["zz"]), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            stub.Report(router_pb2.ReportRequest(node="b", has_queue=True, queued_prefill_s=0.5,
                                                 prefills=[router_pb2.Prefill(model=MODEL, tokens=512, seconds=0.2)]),
                        timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                stub.Report(router_pb2.ReportRequest(node=""), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            scorer = indexer_pb2_grpc.IndexerServiceStub(channel)
            scores = scorer.GetPodScores(indexer_pb2.GetPodScoresRequest(
                prompt=" ".join(map(str, prompt)), model_name=MODEL, pod_identifiers=["a", "b", "gone"]), timeout=10)
            got = {s.pod: s.score for s in scores.scores}
            assert got["a"] == 1.0 and 0 < got["b"] < 1.0 and got["gone"] == 0.0
            with pytest.raises(grpc.RpcError) as err:
                scorer.GetPodScores(indexer_pb2.GetPodScoresRequest(prompt="hello world", model_name=MODEL), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in err.value.details()
        assert router.proc.poll() is None
    finally:
        router.stop()
        a.stop()
        b.stop()


def test_a_node_whose_etcd_lease_expires_is_dropped_at_once(tmp_path: Path, etcd: str) -> None:
    """Heartbeats alone would take a minute here (router.heartbeat_timeout_s=60): the node goes
    when etcd expires its lease, and comes back when it registers again."""
    import time

    from loopback import free_ports

    ports = free_ports(2)
    daemons = {name: start_daemon(tmp_path / name, *events_args(tmp_path, name), "--set",
                                  f"peers.listen=127.0.0.1:{port}", "--set", f"peers.node_id={name}", "--set",
                                  f"peers.etcd={etcd}", "--set", "peers.etcd_ttl_s=2", "--set", "peers.token=t")
               for name, port in zip("ab", ports)}
    router = RouterProc(tmp_path, [source(tmp_path, "a"), source(tmp_path, "b")], "--set", f"router.etcd={etcd}",
                        "--set", "router.heartbeat_timeout_s=60")
    try:
        save(daemons["a"], list(range(16 * 4)))
        router.wait(lambda n: n["available"] == ["a", "b"] and n["index_entries"] == 4)
        daemons["a"].proc.send_signal(signal.SIGSTOP)   # alive to the kernel, silent to everyone
        started = time.monotonic()
        nodes = router.wait(lambda n: n["available"] == ["b"], timeout=30)
        assert nodes["index_entries"] == 0 and time.monotonic() - started < 20
        daemons["a"].proc.send_signal(signal.SIGCONT)
        router.wait(lambda n: n["available"] == ["a", "b"] and n["index_entries"] == 4, timeout=30)
    finally:
        daemons["a"].proc.send_signal(signal.SIGCONT)
        router.stop()
        for d in daemons.values():
            d.stop()
