"""Peers through real daemons: pull and stream from a peer, push while saving, migrate, drain,
per-peer lookups, authentication, and faults (a peer killed mid-transfer, a partitioned peer).

Each test starts its daemons on Unix sockets in its own directory, with peer channels on loopback
ports picked here; the static peer list names them (etcd membership has its own test below)."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvstored
from kvstored import Namespace
from kvstored.errors import NotFound  # noqa: F401  (documents the error kvstored maps to NOT_FOUND)

BLOCK = 64 << 10
NS = Namespace(model="peer-test", block_bytes=BLOCK)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def rows(n: int, seed: int = 0, width: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=(n, width), dtype=np.uint8)


def prompt(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + 16 * n_blocks))


Factory = Callable[..., object]


def cluster(daemon_factory: Factory, names: list[str], *extra: str, token: str = "t0ken") -> dict[str, object]:
    """Start one daemon per name, each listening for peers on loopback and knowing all others."""
    ports = free_ports(len(names))
    static = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, ports))
    out = {}
    for name, port in zip(names, ports):
        out[name] = daemon_factory("--set", f"peers.listen=127.0.0.1:{port}", "--set", f"peers.node_id={name}",
                                   "--set", f"peers.static={static}", "--set", f"peers.token={token}",
                                   "--set", "peers.deadline_s=5", *extra)
    return out


def test_stream_fetches_blocks_from_the_peer_in_order(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = cluster(daemon_factory, ["a", "b"])
    kv = rows(12)
    tokens = prompt(12)
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b:
        assert a.save(tokens, kv).stored == 12
        b.save(tokens[: 16 * 3], kv[:3])            # b already holds the first 3 blocks
        hit = b.lookup(tokens, peers=True)
        assert hit.per_tier == {"dram": 3, "peer": 9} and hit.per_peer == {"a": 9} and hit.blocks == 12
        assert b.lookup(tokens).blocks == 3        # without peers: local only
        stream = b.stream(tokens)
        got = list(stream)
        assert [g.index for g in got] == list(range(12))
        assert [g.tier for g in got] == ["dram"] * 3 + ["peer"] * 9
        assert {g.peer for g in got[3:]} == {"a"}
        assert all(np.array_equal(g.data, kv[g.index]) for g in got)
        assert stream.outcome is not None and stream.outcome.complete and stream.outcome.tokens == 12 * 16
        # the fetched blocks are now b's own
        assert b.lookup(tokens).per_tier == {"dram": 12}
        assert np.array_equal(b.load(tokens).data, kv)
        stats = b.stats()
        assert stats["peer_fetched_blocks"] == 9 and a.stats()["peer_served_blocks"] >= 9
