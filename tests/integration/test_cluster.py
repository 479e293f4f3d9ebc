"""Daemons forming a cluster the way an operator sets one up: membership through a real etcd
(nodes find each other, a killed node leaves when its lease expires, a stopped one at once), mutual
TLS between daemons (and nodes with a foreign or expired certificate kept out), and the safety
rules for the peer listener (a public listener needs authentication or an explicit insecure).

etcd is Debian's etcd-server (tools/ci/install-etcd.sh); the etcd tests skip without it. The TLS
test generates its certificates with the ``cryptography`` package and skips without it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pki as test_pki
import pytest
from loopback import free_ports

import kvstored
from kvstored import Namespace
from kvstored.peers.auth import PeerAuth
from kvstored.peers.connection import PeerConnection
from kvstored.peers.errors import PeerAuthError

BLOCK = 64 << 10
NS = Namespace(model="cluster-test", block_bytes=BLOCK)
TTL_S = 2
Factory = Callable[..., Any]


# -- helpers -------------------------------------------------------------------------------------
def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=(n, BLOCK), dtype=np.uint8)


def prompt(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + 16 * n_blocks))


def peer_view(client: kvstored.Client) -> dict[str, dict[str, Any]]:
    return {p["node_id"]: p for p in client.peers()["peers"]}


def poll(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Call ``check`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s (last: {last!r})")
        time.sleep(interval)


def exits_with(daemon: Any, timeout: float = 30.0) -> int:
    try:
        return int(daemon.proc.wait(timeout))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the daemon is still running after {timeout:g}s:\n{daemon.log()[-3000:]}") from None


def etcd_node(daemon_factory: Factory, endpoint: str, node_id: str, ttl_s: int = TTL_S, *extra: str) -> Any:
    return daemon_factory("--set", f"peers.etcd={endpoint}", "--set", "peers.listen=127.0.0.1:0",
                          "--set", f"peers.node_id={node_id}", "--set", "peers.token=cluster-t0ken",
                          "--set", f"peers.etcd_ttl_s={ttl_s}", "--set", "peers.deadline_s=10", *extra)


def sees(client: kvstored.Client, node_id: str) -> dict[str, Any] | None:
    """The peer's row once it is listed and up (the listing asks each peer a question first)."""
    row = peer_view(client).get(node_id)
    return row if row is not None and row["state"] == "up" else None


def test_etcd_nodes_find_each_other_stream_and_a_killed_node_leaves(daemon_factory: Factory, etcd: str) -> None:
    a = etcd_node(daemon_factory, etcd, "node-a")
    b = etcd_node(daemon_factory, etcd, "node-b")
    with kvstored.Client(a.socket, namespace=NS) as ca, kvstored.Client(b.socket, namespace=NS) as cb:
        info_a, info_b = ca.peers(), cb.peers()
        assert info_a["membership"] == f"etcd {etcd}" and info_b["membership"] == f"etcd {etcd}"
        host_a, _, port_a = info_a["listen"].rpartition(":")
        assert host_a == "127.0.0.1" and int(port_a) > 0, "port 0 must be replaced by the bound port"
        assert info_a["listen"] != info_b["listen"]
        row_a = poll(lambda: sees(cb, "node-a"), 15, "node-b sees node-a through etcd")
        row_b = poll(lambda: sees(ca, "node-b"), 15, "node-a sees node-b through etcd")
        assert row_a["address"] == info_a["listen"] and row_b["address"] == info_b["listen"]
        assert peer_view(ca)["node-a"]["state"] == "self"

        kv = rows(6, seed=1)
        tokens = prompt(6)
        assert ca.save(tokens, kv).stored == 6
        hit = cb.lookup(tokens, peers=True)
        assert hit.per_peer == {"node-a": 6} and hit.blocks == 6
        stream = cb.stream(tokens)
        got = list(stream)
        assert stream.outcome is not None and stream.outcome.complete, stream.outcome
        assert [g.index for g in got] == list(range(6)) and {g.peer for g in got} == {"node-a"}
        assert all(np.array_equal(g.data, kv[g.index]) for g in got)
        assert cb.lookup(tokens).per_tier == {"dram": 6}

        a.stop(signal.SIGKILL)
        # its lease is no longer refreshed: etcd expires it and node-b stops listing node-a
        poll(lambda: "node-a" not in peer_view(cb), TTL_S + 10, "node-b forgets the killed node-a")
        assert set(peer_view(cb)) == {"node-b"}
        out = cb.stream(prompt(2, 50_000))
        assert out.wait().stop == "no_peers" and out.wait().blocks == 0
        # what node-b fetched is its own: still served with node-a gone
        assert np.array_equal(cb.load(tokens).data, kv)


def test_etcd_node_stopped_cleanly_leaves_at_once(daemon_factory: Factory, etcd: str) -> None:
    """With a 30 s lease only a revoked lease (clean shutdown) can explain leaving within seconds."""
    a = etcd_node(daemon_factory, etcd, "node-a", 30)
    b = etcd_node(daemon_factory, etcd, "node-b", 30)
    c = etcd_node(daemon_factory, etcd, "node-c", 30)
    with kvstored.Client(a.socket) as ca:
        poll(lambda: {"node-b", "node-c"} <= set(peer_view(ca)), 15, "node-a sees node-b and node-c")
    assert b.stop(signal.SIGTERM) == 0
    with kvstored.Client(a.socket) as ca, kvstored.Client(c.socket) as cc:
        poll(lambda: "node-b" not in peer_view(ca), 5, "node-a forgets node-b after its clean stop")
        poll(lambda: "node-b" not in peer_view(cc), 5, "node-c forgets node-b after its clean stop")
        assert set(peer_view(ca)) == {"node-a", "node-c"}
        assert sees(ca, "node-c") is not None


def test_etcd_node_that_comes_back_is_found_again(daemon_factory: Factory, etcd: str) -> None:
    a = etcd_node(daemon_factory, etcd, "node-a")
    b = etcd_node(daemon_factory, etcd, "node-b")
    with kvstored.Client(a.socket, namespace=NS) as ca:
        poll(lambda: sees(ca, "node-b"), 15, "node-a sees node-b")
        b.stop(signal.SIGKILL)
        poll(lambda: "node-b" not in peer_view(ca), TTL_S + 10, "node-a forgets the killed node-b")
        b2 = etcd_node(daemon_factory, etcd, "node-b")          # a new process, a new port
        with kvstored.Client(b2.socket, namespace=NS) as cb2:
            new_address = cb2.peers()["listen"]
            row = poll(lambda: sees(ca, "node-b"), 15, "node-a finds node-b again")
            assert row["address"] == new_address
            kv = rows(3, seed=3)
            cb2.save(prompt(3), kv)
            out = ca.stream(prompt(3))
            assert out.wait().complete and np.array_equal(ca.load(prompt(3)).data, kv)


def test_unreachable_etcd_fails_the_start_clearly(daemon_factory: Factory) -> None:
    (dead,) = free_ports(1)
    d = daemon_factory("--set", f"peers.etcd=127.0.0.1:{dead}", "--set", "peers.listen=127.0.0.1:0",
                       "--set", "peers.token=t", "--set", "peers.node_id=a", wait=False)
    assert exits_with(d, 60) == 1
    assert "cannot join the cluster" in d.log() and "etcd" in d.log()


def test_etcd_without_a_listener_fails_the_start(daemon_factory: Factory, etcd: str) -> None:
    d = daemon_factory("--set", f"peers.etcd={etcd}", "--set", "peers.node_id=a", wait=False)
    assert exits_with(d) != 0
    assert "peers.listen" in d.log()


# -- mutual TLS ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeCert:
    ca: str
    cert: str
    key: str

    def flags(self) -> tuple[str, ...]:
        return ("--set", f"peers.tls_ca={self.ca}", "--set", f"peers.tls_cert={self.cert}",
                "--set", f"peers.tls_key={self.key}")


@dataclass(frozen=True)
class Certs:
    a: NodeCert
    b: NodeCert
    foreign: NodeCert       # its own CA: neither trusts nor is trusted by a and b
    expired: NodeCert       # signed by a and b's CA, but expired yesterday


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    test_pki.require()
    d = tmp_path / "pki"
    d.mkdir()
    ca, other = test_pki.make_ca("kvstored cluster CA"), test_pki.make_ca("another cluster's CA")
    ca_pem = test_pki.write(d, "ca", ca, with_key=False)[0]
    other_pem = test_pki.write(d, "other-ca", other, with_key=False)[0]

    def node(name: str, issuer: test_pki.Issued, ca_file: str, days: tuple[int, int] = (-1, 30)) -> NodeCert:
        # a node both listens and dials: its certificate serves both ends of a peer connection
        cert, key = test_pki.write(d, name, test_pki.make_leaf(name, issuer, server=True, client=True, days=days))
        return NodeCert(ca_file, cert, key)

    return Certs(a=node("node-a", ca, ca_pem), b=node("node-b", ca, ca_pem),
                 foreign=node("node-x", other, other_pem),
                 expired=node("node-old", ca, ca_pem, days=(-30, -1)))


def test_mutual_tls_between_daemons(daemon_factory: Factory, certs: Certs) -> None:
    pa, pb, px, po = free_ports(4)
    static = f"a=127.0.0.1:{pa},b=127.0.0.1:{pb}"
    a = daemon_factory("--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a",
                       "--set", f"peers.static={static}", *certs.a.flags())
    b = daemon_factory("--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b",
                       "--set", f"peers.static={static}", *certs.b.flags())
    # intruders know where a listens; neither gets anything from it
    foreign = daemon_factory("--set", f"peers.listen=127.0.0.1:{px}", "--set", "peers.node_id=x",
                             "--set", f"peers.static=a=127.0.0.1:{pa}", *certs.foreign.flags())
    expired = daemon_factory("--set", f"peers.listen=127.0.0.1:{po}", "--set", "peers.node_id=old",
                             "--set", f"peers.static=a=127.0.0.1:{pa}", *certs.expired.flags())
    kv = rows(5, seed=7)
    tokens = prompt(5)
    with kvstored.Client(a.socket, namespace=NS) as ca, kvstored.Client(b.socket, namespace=NS) as cb:
        assert ca.save(tokens, kv).stored == 5
        stream = cb.stream(tokens)
        got = list(stream)
        assert stream.outcome is not None and stream.outcome.complete, stream.outcome
        assert [g.peer for g in got] == ["a"] * 5 and all(np.array_equal(g.data, kv[g.index]) for g in got)
        assert peer_view(cb)["a"]["state"] == "up" and peer_view(ca)["b"]["state"] == "up"

    for intruder in (foreign, expired):
        with kvstored.Client(intruder.socket, namespace=NS) as cx:
            out = cx.stream(tokens)
            end = out.wait()
            assert end.stop == "unreachable" and end.blocks == 0, end
            assert "TLS" in end.detail, end.detail
            assert cx.lookup(tokens).blocks == 0
            row = peer_view(cx)["a"]
            assert row["state"] == "refused" and "TLS" in row["last_error"], row
            hit = cx.lookup(tokens, peers=True)
            assert hit.per_peer == {} and hit.blocks == 0
    with kvstored.Client(a.socket, namespace=NS) as ca:
        assert ca.stats()["peer_served_blocks"] == 5   # b's stream only
    # the refusing side says why too, and a node warns about its own expired certificate at start
    # (a review found both silent)
    refusals = [line for line in a.log().splitlines() if "refused a peer's TLS handshake" in line]
    assert any("expired" in line for line in refusals) and len(refusals) >= 2, a.log()[-3000:]
    assert "expired on" in expired.log() and "peers will refuse it" in expired.log()


def test_push_and_migrate_over_mutual_tls(daemon_factory: Factory, certs: Certs) -> None:
    pa, pb = free_ports(2)
    static = f"a=127.0.0.1:{pa},b=127.0.0.1:{pb}"
    common = ("--set", f"peers.static={static}", "--set", "peers.deadline_s=5")
    a = daemon_factory("--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a", *common,
                       *certs.a.flags())
    b = daemon_factory("--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b", *common,
                       *certs.b.flags())
    with kvstored.Client(a.socket, namespace=NS) as ca, kvstored.Client(b.socket, namespace=NS) as cb:
        kv = rows(3, seed=8)
        cb.save(prompt(3), kv, push_to="a")
        poll(lambda: ca.lookup(prompt(3)).blocks == 3, 10, "b's push reaches a")
        assert np.array_equal(ca.load(prompt(3)).data, kv)
        kv2 = rows(4, seed=9)
        cb.save(prompt(4, 20_000), kv2)
        final = list(cb.migrate("a"))[-1]
        assert final["done"] and final["failed_blocks"] == 0, final
        assert np.array_equal(ca.load(prompt(4, 20_000)).data, kv2)


def test_unreadable_tls_files_fail_the_start(daemon_factory: Factory, certs: Certs, tmp_path: Path) -> None:
    d = daemon_factory("--set", "peers.listen=127.0.0.1:0", "--set", f"peers.tls_ca={certs.a.ca}",
                       "--set", f"peers.tls_cert={tmp_path / 'missing.pem'}", "--set", f"peers.tls_key={certs.a.key}",
                       wait=False)
    assert exits_with(d) == 1
    assert "cannot join the cluster" in d.log() and "missing.pem" in d.log()


# -- listener safety -----------------------------------------------------------------------------
def _listen_port(client: kvstored.Client) -> int:
    host, _, port = client.peers()["listen"].rpartition(":")
    assert host == "0.0.0.0" and int(port) > 0
    return int(port)


def _connects(port: int, auth: PeerAuth) -> str:
    """"ok", or why the listener refused the connection."""
    async def main() -> str:
        try:
            async with asyncio.timeout(10):
                conn = await PeerConnection.open(("127.0.0.1", port), auth)
        except PeerAuthError as exc:
            return str(exc)
        conn.close()
        return "ok"
    return asyncio.run(main())


def test_public_peer_listener_needs_auth_or_explicit_insecure(daemon_factory: Factory) -> None:
    with_token = daemon_factory("--set", "peers.listen=0.0.0.0:0", "--set", "peers.token=x")
    insecure = daemon_factory("--set", "peers.listen=0.0.0.0:0", "--set", "peers.insecure=true")
    neither = daemon_factory("--set", "peers.listen=0.0.0.0:0", wait=False)
    assert exits_with(neither) == 2
    assert "peers.insecure" in neither.log() and "peers.listen" in neither.log()

    with kvstored.Client(with_token.socket) as c:
        port = _listen_port(c)
    assert _connects(port, PeerAuth(token="x")) == "ok"
    assert "refused" in _connects(port, PeerAuth(token="not-x"))     # the public listener does check
    assert _connects(port, PeerAuth()) != "ok"
    with kvstored.Client(insecure.socket) as c:
        port = _listen_port(c)
    assert _connects(port, PeerAuth(insecure=True)) == "ok"
