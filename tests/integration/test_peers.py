"""Peers through real daemons: pull and stream from a peer, push while saving, migrate, drain,
per-peer lookups, authentication, and faults (a peer killed mid-transfer, a partitioned peer).

Each test starts its daemons on Unix sockets in its own directory, with peer channels on loopback
ports picked here; the static peer list names them (etcd membership has its own test below)."""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from loopback import free_ports

import kvstored
from kvstored import Namespace

BLOCK = 64 << 10
NS = Namespace(model="peer-test", block_bytes=BLOCK)


def rows(n: int, seed: int = 0, width: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=(n, width), dtype=np.uint8)


def prompt(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + 16 * n_blocks))


Factory = Callable[..., object]


def cluster(daemon_factory: Factory, names: list[str], *extra: str, token: str = "t0ken",
            only: dict[str, tuple[str, ...]] | None = None) -> dict[str, object]:
    """Start one daemon per name, each listening for peers on loopback and knowing all others
    (``only``: more flags for some of them)."""
    ports = free_ports(len(names))
    static = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, ports))
    out = {}
    for name, port in zip(names, ports):
        out[name] = daemon_factory("--set", f"peers.listen=127.0.0.1:{port}", "--set", f"peers.node_id={name}",
                                   "--set", f"peers.static={static}", "--set", f"peers.token={token}",
                                   "--set", "peers.deadline_s=5", *extra, *(only or {}).get(name, ()))
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


def test_evict_right_after_a_stream_drops_the_streamed_blocks(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    # Regression: the stream's lease was released in the background, and an evict that overtook
    # the release found the chain pinned and dropped nothing (one time in two).
    d = cluster(daemon_factory, ["a", "b"])
    kv = rows(8, seed=3)
    tokens = prompt(8)
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b:
        assert a.save(tokens, kv).stored == 8
        for _ in range(6):
            assert b.stream(tokens).wait().complete
            assert b.evict() == 8
            assert b.lookup(tokens).blocks == 0


def test_pull_brings_a_prefix_here_and_leaves_nothing_leased(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = cluster(daemon_factory, ["a", "b"])
    kv = rows(10, seed=5)
    tokens = prompt(10)
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b:
        assert a.save(tokens[: 16 * 7], kv[:7]).stored == 7          # a holds the first 7 blocks only
        b.save(tokens[:16], kv[:1])                                  # b already holds block 0
        out = b.pull(tokens)
        assert (out.blocks, out.requested, out.tokens) == (7, 10, 7 * 16)
        assert out.stop == "missing" and not out.complete           # short: the engine computes the rest
        assert b.lookup(tokens).per_tier == {"dram": 7}
        assert np.array_equal(b.load(tokens[: 16 * 7]).data, kv[:7])
        assert b.stats()["active_leases"] == 0
        assert b.evict() == 7                                         # nothing pinned by the pull
        assert b.stats()["peer_fetched_blocks"] == 6


def test_stream_into_engine_buffers_each_block_in_place_on_arrival(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Prefill on a, decode on b: b's engine sees block i in its buffers when block i's event comes."""
    d = cluster(daemon_factory, ["a", "b"])
    layers, shape = 2, (10, 2, 16, 4, 32)   # block-first, 10 blocks: 2*16*4*32*2 B = 8 KiB per layer
    ns = Namespace(model="pd", kv_dtype="float16")
    rng = np.random.default_rng(5)
    src = [kvstored.shm.empty(shape, "float16") for _ in range(layers)]
    dst = [kvstored.shm.empty(shape, "float16") for _ in range(layers)]
    for t in src:
        t.numpy()[...] = rng.standard_normal(shape).astype(np.float16)
    tokens = prompt(8)
    with kvstored.Client(d["a"].socket) as a, kvstored.Client(d["b"].socket) as b:
        bufs_a = a.register_buffers([t.numpy() for t in src], 0, namespace=ns)
        bufs_b = b.register_buffers([t.numpy() for t in dst], 0, namespace=ns)
        assert a.save_blocks(bufs_a, list(range(8)), tokens).stored == 8
        targets = [9, 8, 7, 6, 5, 4, 3, 2]
        stream = b.stream(tokens, buffers=bufs_b, block_ids=targets)
        seen = []
        for arrival in stream:
            i = arrival.index
            assert arrival.data is None and arrival.tier == "peer" and arrival.peer == "a"
            for s, t in zip(src, dst):   # in place now, not later
                assert np.array_equal(t.numpy()[targets[i]], s.numpy()[i])
            seen.append(i)
        assert seen == list(range(8)) and stream.outcome is not None and stream.outcome.complete
        assert not dst[0].numpy()[:2].any()   # blocks 0 and 1 of the buffers were not targets
        with pytest.raises(kvstored.InvalidArgument):
            b.stream(tokens, buffers=bufs_b, block_ids=[0])


def test_push_on_save_arrives_chunk_by_chunk(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Chunked prefill on a with push_to=b: each chunk reaches b before the next one is saved."""
    d = cluster(daemon_factory, ["a", "b"])
    kv = rows(12, seed=2)
    tokens = prompt(12)
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b:
        for chunk in range(3):
            upto = 4 * (chunk + 1)
            a.save(tokens[: 16 * upto], kv[:upto], push_to="b")
            deadline = time.monotonic() + 10
            while b.lookup(tokens).blocks < upto and time.monotonic() < deadline:
                time.sleep(0.01)
            assert b.lookup(tokens).blocks == upto     # this chunk is there before the next is saved
        assert np.array_equal(b.load(tokens).data, kv)
        assert a.stats()["peer_pushed_blocks"] == 12 and b.stats()["peer_received_blocks"] == 12
        with pytest.raises(kvstored.NotFound, match="unknown peer 'nobody'"):
            a.save(prompt(1, 9000), rows(1), push_to="nobody")
        assert a.lookup(prompt(1, 9000)).blocks == 0   # refused before anything was stored


def test_lookup_reports_hits_per_peer(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = cluster(daemon_factory, ["a", "b", "c"])
    kv = rows(10, seed=4)
    tokens = prompt(10)
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b, \
            kvstored.Client(d["c"].socket, namespace=NS) as c:
        a.save(tokens[: 16 * 2], kv[:2])
        b.save(tokens, kv)
        c.save(tokens[: 16 * 6], kv[:6])
        hit = a.lookup(tokens, peers=True)
        assert hit.per_peer == {"b": 8, "c": 4} and hit.per_tier == {"dram": 2, "peer": 8}
        out = a.stream(tokens)
        assert [x.peer for x in out][2:] == ["b"] * 8      # fetched from the peer holding the most
        assert out.outcome is not None and out.outcome.complete


def test_peer_killed_mid_transfer_gives_a_short_clean_result(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    from netfault import FaultProxy

    pa, pb = free_ports(2)
    proxy = FaultProxy(("127.0.0.1", pa), rate_bytes_s=4 << 20)
    try:
        common = ("--set", "peers.token=t", "--set", "peers.deadline_s=20", "--dram-capacity", "128MiB")
        a = daemon_factory("--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a",
                           "--set", f"peers.static=b=127.0.0.1:{pb}", *common)
        b = daemon_factory("--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b",
                           "--set", f"peers.static=a=127.0.0.1:{proxy.port}", *common)
        n = 400   # 25 MiB: far more than the socket buffers between a and b hold
        kv = rows(n, seed=6)
        tokens = prompt(n)
        with kvstored.Client(a.socket, namespace=NS) as ca, kvstored.Client(b.socket, namespace=NS) as cb:
            assert ca.save(tokens, kv).stored == n
            stream = cb.stream(tokens)
            got = []
            started = time.monotonic()
            for arrival in stream:
                got.append(arrival)
                if len(got) == 3:
                    a.stop(signal.SIGKILL)
            outcome = stream.outcome
            assert outcome is not None and outcome.stop == "peer_closed", outcome
            assert 3 <= outcome.blocks < n and len(got) == outcome.blocks
            assert time.monotonic() - started < 20
            assert all(np.array_equal(g.data, kv[g.index]) for g in got)
            # b kept exactly the complete blocks; the partial one left no trace
            assert cb.lookup(tokens).blocks == outcome.blocks
            assert np.array_equal(cb.load(tokens).data, kv[: outcome.blocks])
            saved = cb.save(tokens, kv)              # the engine recomputes and saves the rest
            assert (saved.present, saved.stored) == (outcome.blocks, n - outcome.blocks)
            assert cb.stats()["peer_failures"] >= 1
    finally:
        proxy.close()


def test_partitioned_peer_times_out_within_the_deadline(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    from netfault import FaultProxy

    pa, pb = free_ports(2)
    proxy = FaultProxy(("127.0.0.1", pa), rate_bytes_s=4 << 20)
    try:
        common = ("--set", "peers.token=t", "--set", "peers.deadline_s=2", "--dram-capacity", "128MiB")
        a = daemon_factory("--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a", *common)
        b = daemon_factory("--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b",
                           "--set", f"peers.static=a=127.0.0.1:{proxy.port}", *common)
        n = 200
        kv = rows(n, seed=7)
        tokens = prompt(n)
        with kvstored.Client(a.socket, namespace=NS) as ca, kvstored.Client(b.socket, namespace=NS) as cb:
            ca.save(tokens, kv)
            stream = cb.stream(tokens)
            got = 0
            started = time.monotonic()
            for _ in stream:
                got += 1
                if got == 2:
                    proxy.stalled.set()            # the network between a and b goes silent
            elapsed = time.monotonic() - started
            outcome = stream.outcome
            assert outcome is not None and outcome.stop == "timeout" and 2 <= outcome.blocks < n, outcome
            assert elapsed < 2 + 5, f"the stream took {elapsed:.1f}s with a 2s deadline"
            assert cb.lookup(tokens).blocks == outcome.blocks
            assert np.array_equal(cb.load(tokens).data, kv[: outcome.blocks])
            proxy.rate = 0                          # the partition heals: the rest comes
            proxy.stalled.clear()
            again = cb.stream(tokens)
            assert again.wait().complete and np.array_equal(cb.load(tokens).data, kv)
    finally:
        proxy.close()


def test_wrong_token_is_refused_and_shown(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    pa, pb = free_ports(2)
    a = daemon_factory("--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a",
                       "--set", "peers.token=right")
    b = daemon_factory("--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b",
                       "--set", "peers.token=wrong", "--set", f"peers.static=a=127.0.0.1:{pa}")
    kv = rows(4, seed=8)
    with kvstored.Client(a.socket, namespace=NS) as ca, kvstored.Client(b.socket, namespace=NS) as cb:
        ca.save(prompt(4), kv)
        out = cb.stream(prompt(4))
        assert out.wait().stop == "unreachable" and "token rejected" in out.wait().detail
        assert cb.lookup(prompt(4)).blocks == 0
        view = {p["node_id"]: p for p in cb.peers()["peers"]}
        assert view["a"]["state"] == "refused" and "token rejected" in view["a"]["last_error"]
        assert view["b"]["state"] == "self"
        assert "wrong token" in a.log() or "token" in a.log()


def test_unauthenticated_listener_on_a_public_address_refuses_to_start(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--set", "peers.listen=0.0.0.0:0", wait=False)
    assert d.proc.wait(30) == 2
    assert "peers.insecure = true" in d.log()


def test_migrate_and_drain(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = cluster(daemon_factory, ["a", "b", "c"])
    other = Namespace(model="other", block_bytes=BLOCK)
    trees = {i: (prompt(6, 100_000 * (i + 1)), rows(6, seed=10 + i)) for i in range(4)}
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b, \
            kvstored.Client(d["c"].socket, namespace=NS) as c:
        for i, (tokens, kv) in trees.items():
            a.save(tokens, kv, namespace=NS if i < 3 else other)
        # branches below a shared prefix: the child must travel after its parent
        a.save(trees[0][0][:32] + prompt(2, 7_000_000), np.concatenate([trees[0][1][:2], rows(2, seed=99)]))
        progress = list(a.migrate("b", model="peer-test"))
        assert progress[-1]["done"] and progress[-1]["pushed_blocks"] == progress[-1]["total_blocks"] == 20
        assert all(p["pushed_blocks"] <= q["pushed_blocks"] for p, q in itertools.pairwise(progress))
        for i in range(3):
            assert np.array_equal(b.load(trees[i][0]).data, trees[i][1])
        assert b.lookup(trees[3][0], namespace=other).blocks == 0    # another model: not migrated
        assert a.lookup(trees[0][0]).blocks == 6                     # migrate copies
        final = list(a.migrate(drain=True))[-1]
        assert final["failed_blocks"] == 0 and final["dropped_blocks"] == final["total_blocks"] == 26
        assert a.stats()["index_blocks"] == 0
        for i, (tokens, kv) in trees.items():
            ns = NS if i < 3 else other
            held = [x.lookup(tokens, namespace=ns).blocks for x in (b, c)]
            assert 6 in held, f"tree {i} did not land whole on one node: {held}"
            owner = b if held[0] == 6 else c
            assert np.array_equal(owner.load(tokens, namespace=ns).data, kv)


def test_stream_larger_than_dram(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """b's arena holds 64 blocks. Into engine buffers a 100-block prompt streams whole (each
    block is unpinned once copied); in arena mode every block stays leased until the stream
    ends, so it stops at what fits, says so, and keeps what came."""
    ports = free_ports(2)
    static = f"a=127.0.0.1:{ports[0]},b=127.0.0.1:{ports[1]}"
    common = ("--set", f"peers.static={static}", "--set", "peers.token=t")
    a = daemon_factory("--set", f"peers.listen=127.0.0.1:{ports[0]}", "--set", "peers.node_id=a",
                       "--dram-capacity", "64MiB", *common)
    b = daemon_factory("--set", f"peers.listen=127.0.0.1:{ports[1]}", "--set", "peers.node_id=b",
                       "--dram-capacity", "4MiB", "--set", "dram.page_bytes=1MiB", *common)
    n = 100
    tokens = prompt(n)
    shape = (n, 16, 1024)                      # block-first, float32: 64 KiB per block
    src = kvstored.shm.empty(shape, "float32")
    dst = kvstored.shm.empty(shape, "float32")
    src.numpy()[...] = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    ns = Namespace(model="big", kv_dtype="float32")
    with kvstored.Client(a.socket) as ca, kvstored.Client(b.socket) as cb:
        bufs_a = ca.register_buffers([src.numpy()], 0, namespace=ns)
        bufs_b = cb.register_buffers([dst.numpy()], 0, namespace=ns)
        assert ca.save_blocks(bufs_a, list(range(n)), tokens).stored == n
        out = cb.stream(tokens, buffers=bufs_b, block_ids=list(range(n)))
        assert out.wait().complete and np.array_equal(dst.numpy(), src.numpy())
        cb.evict()
        arena_mode = cb.stream(tokens, namespace=bufs_b.namespace)
        got = list(arena_mode)
        end = arena_mode.outcome
        assert end is not None and end.stop == "no_room" and 0 < end.blocks < n and len(got) == end.blocks
        assert all(np.array_equal(g.data.view(np.float32), src.numpy()[g.index].ravel()) for g in got)
        assert cb.lookup(tokens, namespace=bufs_b.namespace).blocks == end.blocks


def test_drain_sends_around_a_static_peer_that_is_down(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Regression: a drain picked a target per tree among all static peers, up or not, so the trees
    assigned to a stopped node failed although another peer was up."""
    d = cluster(daemon_factory, ["a", "b", "c"])
    chains = {i: (prompt(3, 10_000 * (i + 1)), rows(3, seed=i)) for i in range(8)}   # 8 trees
    with kvstored.Client(d["b"].socket, namespace=NS) as b:
        for tokens, kv in chains.values():
            b.save(tokens, kv)
    d["a"].stop()
    with kvstored.Client(d["b"].socket, namespace=NS) as b:
        last = list(b.migrate(drain=True))[-1]
        assert (last["pushed_blocks"], last["failed_blocks"], last["dropped_blocks"]) == (24, 0, 24), last
    with kvstored.Client(d["c"].socket, namespace=NS) as c:
        for tokens, kv in chains.values():
            assert np.array_equal(c.load(tokens).data, kv)


def test_a_reader_that_stops_reading_does_not_pin_the_senders_blocks(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Regression: a fetching peer that stopped reading kept the serving node's blocks checked out
    until its socket died; the server now gives up after peers.deadline_s and releases them."""
    from netfault import FaultProxy

    pa, pb = free_ports(2)
    proxy = FaultProxy(("127.0.0.1", pa), rate_bytes_s=4 << 20)   # slow enough to still be sending
    big = Namespace(model="pinned", block_bytes=1 << 20)   # a fetch's first 64 blocks outgrow any socket buffer
    try:
        common = ("--set", "peers.token=t", "--set", "peers.deadline_s=2", "--dram-capacity", "256MiB",
                  "--set", "dram.page_bytes=2MiB")
        a = daemon_factory("--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a", *common)
        b = daemon_factory("--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b",
                           "--set", f"peers.static=a=127.0.0.1:{proxy.port}", *common)
        tokens = prompt(100)
        with kvstored.Client(a.socket, namespace=big) as ca, kvstored.Client(b.socket, namespace=big) as cb:
            ca.save(tokens, rows(100, seed=3, width=1 << 20))
            stream = cb.stream(tokens)
            next(iter(stream))
            proxy.stalled.set()        # nothing moves any more: a's sends block, as with a stuck reader
            deadline = time.monotonic() + 10
            while "gave up a fetch" not in a.log() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "gave up a fetch" in a.log()
            assert ca.evict() == 100   # nothing of the chain is still checked out on a
            stream.close()
    finally:
        proxy.close()


def test_a_refused_push_says_why(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Regression: a push into a node with no room said only "refused by the receiver", and a
    pull short of room on the pulling node named the peer as if it had none."""
    d = cluster(daemon_factory, ["a", "b"], "--set", "ssd.enabled=false", only={"a": ("--dram-capacity", "256MiB")})
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b:
        tokens = prompt(1200)                       # one chain of 75 MiB; b's arena is 64 MiB
        assert a.save(tokens, rows(1200)).stored == 1200
        last = list(a.migrate("b", tokens=tokens))[-1]
        assert last["failed_blocks"] > 0 and "DRAM tier is full" in last["detail"], last
        b.evict()
        outcome = b.stream(tokens).wait()
        assert outcome.stop == "no_room" and not outcome.detail.startswith("a:"), outcome


def test_migrate_of_a_prefix_moves_that_chain_only(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Regression: a prefix sent as packed hashes (as the SDK sends it), or one of no whole block,
    was taken for no prefix at all: every block of every model moved, and a drain dropped them all."""
    d = cluster(daemon_factory, ["a", "b"])
    x, y = prompt(2, start=10_000), prompt(3, start=20_000)
    with kvstored.Client(d["a"].socket, namespace=NS) as a, kvstored.Client(d["b"].socket, namespace=NS) as b:
        a.save(x, rows(2, seed=1))
        a.save(y, rows(3, seed=2))
        for short in ({"tokens": [1, 2, 3]}, {"hashes": []}):
            last = list(a.migrate("b", **short))[-1]   # type: ignore[arg-type]
            assert last["done"] and last["total_blocks"] == 0, (short, last)
            migrate_rpc, a._stub.Migrate = a._stub.Migrate, None   # a daemon from before moved everything:
            try:                                                   # the SDK does not even ask
                assert list(a.migrate(drain=True, **short))[-1]["dropped_blocks"] == 0   # type: ignore[arg-type]
            finally:
                a._stub.Migrate = migrate_rpc
        last = list(a.migrate("b", tokens=x))[-1]
        assert last["total_blocks"] == last["pushed_blocks"] == 2, last
        assert b.lookup(x).blocks == 2 and b.lookup(y).blocks == 0
        last = list(a.migrate(drain=True, hashes=kvstored.block_hashes(x)))[-1]
        assert last["dropped_blocks"] == 2, last
        assert a.lookup(x).blocks == 0 and a.lookup(y).blocks == 3
        a.save(x, rows(2, seed=3), cache_salt="tenant-1")   # a salted prompt moves by its tokens too
        last = list(a.migrate("b", tokens=x, cache_salt="tenant-1"))[-1]
        assert last["pushed_blocks"] == 2 and b.lookup(x, cache_salt="tenant-1").blocks == 2, last


def test_migrate_to_this_node_is_refused_by_name(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = cluster(daemon_factory, ["a", "b"])
    with kvstored.Client(d["a"].socket, namespace=NS) as a:
        a.save(prompt(2), rows(2))
        with pytest.raises(kvstored.InvalidArgument, match="'a' is this node"):
            list(a.migrate("a"))
