"""The SDK against a real daemon: save, reuse, load, engine buffers, leases, client death."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import kvstored
from kvstored import Namespace


def rows(n: int, width: int = 1024, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=(n, width), dtype=np.uint8)


def test_save_then_reuse_prefix_then_load(client) -> None:  # type: ignore[no-untyped-def]
    system = np.arange(16 * 8)
    first = np.concatenate([system, np.arange(5000, 5000 + 16 * 2 + 5)])  # 10 blocks + 5-token tail
    kv = rows(10)
    assert client.lookup(first).tokens == 0
    saved = client.save(first, kv)
    assert (saved.present, saved.stored, saved.tokens) == (0, 10, 160)
    second = np.concatenate([system, np.arange(9000, 9000 + 16 * 3)])
    hit = client.lookup(second)
    assert (hit.tokens, hit.blocks, hit.per_tier) == (128, 8, {"dram": 8})
    loaded = client.load(second)
    assert loaded.blocks == 8 and np.array_equal(loaded.data, kv[:8])
    # the second request saves only its own suffix
    again = client.save(second, np.concatenate([kv[:8], rows(3, seed=1)]))
    assert (again.present, again.stored) == (8, 3)


def test_load_into_out_and_by_engine_hashes(client) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(16 * 4))
    kv = rows(4, 4096)
    client.save(tokens, kv)
    out = np.zeros((8, 4096), dtype=np.uint8)
    res = client.load(hashes=kvstored.block_hashes(tokens), out=out)
    assert res.blocks == 4 and np.shares_memory(res.data, out) and np.array_equal(out[:4], kv)
    assert not out[4:].any()


def test_torch_tensors_round_trip(client) -> None:  # type: ignore[no-untyped-def]
    ns = Namespace(model="tiny-llama", kv_dtype="bfloat16")
    kv = torch.randn(3, 2, 16, 4, 8).to(torch.bfloat16)  # (blocks, K/V, tokens, heads, dim)
    tokens = torch.arange(48)
    assert client.save(tokens, kv, namespace=ns).stored == 3
    out = torch.zeros_like(kv)
    res = client.load(tokens, out=out, namespace=ns)
    assert res.blocks == 3 and torch.equal(out, kv)


def test_namespaces_never_mix(client) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(32))
    client.save(tokens, rows(2), namespace=Namespace(model="a"))
    assert client.lookup(tokens, namespace=Namespace(model="b")).blocks == 0
    assert client.lookup(tokens, namespace=Namespace(model="a", tp_rank=1, tp_size=2)).blocks == 0
    assert client.lookup(tokens, namespace=Namespace(model="a")).blocks == 2


def test_tenant_salt_isolates_prefixes(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket, cache_salt="tenant-a") as a, \
            kvstored.Client(daemon.socket, cache_salt="tenant-b") as b:
        a.save(list(range(32)), rows(2))
        assert a.lookup(list(range(32))).blocks == 2
        assert b.lookup(list(range(32))).blocks == 0


def test_a_salted_client_takes_engine_hashes(daemon) -> None:  # type: ignore[no-untyped-def]
    """(review) A client salted at construction refused every hashes= call ("cache_salt applies
    to tokens") unless each passed cache_salt="": the salt is for the calls that hash tokens, an
    engine's hashes carry the salt it hashed with. A salt passed with the hashes is still refused."""
    tokens = list(range(48))
    with kvstored.Client(daemon.socket, cache_salt="tenant-a") as a:
        a.save(tokens, rows(3))
        salted = kvstored.block_hashes(tokens, cache_salt="tenant-a")
        assert a.lookup(hashes=salted).blocks == 3
        assert np.array_equal(a.load(hashes=salted).data, rows(3))
        assert a.lookup(hashes=kvstored.block_hashes(tokens)).blocks == 0   # unsalted keys: not the tenant's
        with pytest.raises(kvstored.InvalidArgument, match="cache_salt applies to tokens"):
            a.lookup(hashes=salted, cache_salt="tenant-a")


@pytest.mark.parametrize("layout", ["vllm_flash", "block_first", "sglang_pages"])
def test_registered_buffers_save_and_load_blocks(client, layout: str) -> None:  # type: ignore[no-untyped-def]
    layers, nblocks, bs, heads, dim = 3, 12, 16, 2, 8
    ns = Namespace(model=f"m-{layout}", kv_dtype="float16")
    if layout == "vllm_flash":  # per layer (2, num_blocks, block_size, heads, dim)
        shape, dim_of_block = (2, nblocks, bs, heads, dim), 1
        src = [kvstored.shm.empty(shape, "float16") for _ in range(layers)]
        dst = [kvstored.shm.empty(shape, "float16") for _ in range(layers)]
    elif layout == "block_first":  # per layer (num_blocks, 2, block_size, heads, dim)
        shape, dim_of_block = (nblocks, 2, bs, heads, dim), 0
        src = [kvstored.shm.empty(shape, "float16") for _ in range(layers)]
        dst = [kvstored.shm.empty(shape, "float16") for _ in range(layers)]
    else:  # one buffer for all layers: (num_pages, layers, 2, page, heads, dim)
        shape, dim_of_block = (nblocks, layers, 2, bs, heads, dim), 0
        src = [kvstored.shm.empty(shape, "float16")]
        dst = [kvstored.shm.empty(shape, "float16")]
    rng = np.random.default_rng(3)
    for t in src:
        t.numpy()[...] = rng.standard_normal(t.shape).astype(np.float16)
    b_src = client.register_buffers([t.numpy() for t in src], dim_of_block, namespace=ns)
    b_dst = client.register_buffers([t.numpy() for t in dst], dim_of_block, namespace=ns)
    assert b_src.num_blocks == nblocks and b_src.layout == b_dst.layout
    tokens = np.arange(16 * 4 + 3)
    saved = client.save_blocks(b_src, [7, 2, 9, 4], tokens)
    assert (saved.present, saved.stored) == (0, 4)
    loaded = client.load_blocks(b_dst, [0, 1, 2, 3], tokens)
    assert loaded.blocks == 4
    for s, d in zip(src, dst):
        a, b = s.numpy(), d.numpy()
        take = (slice(None),) * dim_of_block
        for i, j in zip([7, 2, 9, 4], [0, 1, 2, 3]):
            assert np.array_equal(a[(*take, i)], b[(*take, j)])
        untouched = [k for k in range(nblocks) if k not in (0, 1, 2, 3)]
        assert not b[(*take, untouched)].any()
    # the layout signature is part of the buffers' namespace: rows are readable there, not elsewhere
    assert b_src.namespace.layout == b_src.layout and client.load(tokens, namespace=b_src.namespace).blocks == 4
    assert client.load(tokens, namespace=ns).blocks == 0
    client.unregister_buffers(b_src)
    with pytest.raises(kvstored.NotFound):
        client.save_blocks(b_src, [0], np.arange(16))


def test_blocks_never_cross_layouts(client) -> None:  # type: ignore[no-untyped-def]
    ns = Namespace(model="two-layouts", kv_dtype="float16")
    flash = kvstored.shm.empty((2, 4, 16, 2, 8), "float16")  # (K/V, blocks, tokens, heads, dim)
    first = kvstored.shm.empty((4, 16, 2, 2, 8), "float16")  # (blocks, tokens, K/V, heads, dim)
    same = kvstored.shm.empty((4, 2, 16, 2, 8), "float16")   # (blocks, K/V, tokens, heads, dim)
    flash.numpy()[...] = 1
    a = client.register_buffers([flash.numpy()], 1, namespace=ns)
    b = client.register_buffers([first.numpy()], 0, namespace=ns)
    c = client.register_buffers([same.numpy()], 0, namespace=ns)
    assert c.layout == a.layout  # a block's payload is its sub-tensor in C order: these agree
    assert a.block_bytes == b.block_bytes and a.layout != b.layout
    client.save_blocks(a, [0], list(range(16)))
    assert client.load_blocks(b, [0], list(range(16))).blocks == 0  # same bytes, other layout: a miss
    assert not first.numpy().any()
    assert client.load_blocks(c, [3], list(range(16))).blocks == 1 and (same.numpy()[3] == 1).all()
    with pytest.raises(kvstored.InvalidArgument, match="layout"):
        client.register_buffers([first.numpy()], 0, namespace=Namespace(model="x", layout=a.layout))


def test_load_blocks_reports_each_layer(client) -> None:  # type: ignore[no-untyped-def]
    layers = [kvstored.shm.empty((2, 8, 16, 2, 8), "float16") for _ in range(4)]
    for i, t in enumerate(layers):
        t.numpy()[...] = i + 1
    ns = Namespace(model="overlap", kv_dtype="float16")
    src = client.register_buffers([t.numpy() for t in layers], 1, namespace=ns)
    client.save_blocks(src, [0, 1, 2], list(range(48)))
    dst_layers = [kvstored.shm.empty((2, 8, 16, 2, 8), "float16") for _ in range(4)]
    dst = client.register_buffers([t.numpy() for t in dst_layers], 1, namespace=ns)
    handle = client.load_blocks(dst, [5, 6, 7], list(range(48)), wait=False)
    for i, t in enumerate(dst_layers):
        handle.wait_layer(i, timeout=30)
        assert (t.numpy()[:, 5:8] == i + 1).all()  # layer i is complete when reported
    assert handle.wait(timeout=30).blocks == 3 and handle.result().per_tier == {"dram": 3}
    missing = client.load_blocks(dst, [0], list(range(900, 916)), wait=False)
    assert missing.wait(timeout=30).blocks == 0


def test_torch_shared_buffers_register(client) -> None:  # type: ignore[no-untyped-def]
    buf = kvstored.shm.empty((2, 6, 16, 2, 4), "bfloat16")
    t = buf.torch()
    t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    ns = Namespace(model="torch-buf", kv_dtype="bfloat16")
    b = client.register_buffers([t], block_dim=1, namespace=ns)
    assert b.layout == "bfloat16[2, 16, 2, 4]"
    client.save_blocks(b, [5], list(range(16)))
    other = kvstored.shm.empty((2, 6, 16, 2, 4), "bfloat16")
    b2 = client.register_buffers([other.torch()], block_dim=1, namespace=ns)
    client.load_blocks(b2, [0], list(range(16)))
    assert torch.equal(other.torch()[:, 0], t[:, 5])


@pytest.mark.parametrize("ssd", [False, True])
def test_lru_eviction_under_pressure(daemon_factory, ssd: bool) -> None:  # type: ignore[no-untyped-def]
    # the test daemon has a 64 MiB arena in 1 MiB pages; blocks of 256 KiB -> 256 slots
    d = daemon_factory("--set", f"ssd.enabled={str(ssd).lower()}")
    client = kvstored.Client(d.socket)
    width = 256 << 10
    kept = np.arange(16 * 16)
    client.save(kept, rows(16, width))
    for i in range(30):  # 30 x 16 blocks = 480 blocks through a 256-block tier
        client.save(np.arange(16 * 16) + 100_000 * (i + 1), rows(16, width, seed=i))
        assert client.lookup(kept).blocks == 16  # recently used: survives
    st = client.stats()
    assert int(st["tiers"][0]["evictions"]) > 0
    assert int(st["tiers"][0]["used_bytes"]) <= int(st["tiers"][0]["capacity_bytes"])
    oldest = client.lookup(np.arange(16 * 16) + 100_000)
    if ssd:  # the oldest went down to the SSD tier, and is still served from there
        assert oldest.per_tier == {"ssd": 16}
        assert np.array_equal(client.load(np.arange(16 * 16) + 100_000).data, rows(16, width, seed=0))
    else:  # the oldest went first
        assert oldest.blocks == 0
    client.close()


def test_dead_client_leases_are_released(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket) as c:
        c.save(np.arange(32), rows(2))
    code = f"""
import time
import numpy as np
import kvstored
from kvstored_client.contract.proto import kvstored_pb2 as pb
c = kvstored.Client({daemon.socket!r})
keys = pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(32)))
c._stub.Lookup(pb.LookupRequest(namespace_id=c._ns(None)[0], lease=True, session_id=c._session(), keys=keys))
print("leased", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "leased"
        with kvstored.Client(daemon.socket) as c:
            st = c.stats()
            assert int(st["active_leases"]) == 1 and int(st["clients"]) == 1
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and int(c.stats()["active_leases"]):
                time.sleep(0.05)
            st = c.stats()
            assert int(st["active_leases"]) == 0 and int(st["clients"]) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_lease_expiry_is_reported(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--set", "leases.ttl_s=0.3", "--set", "leases.reap_interval_s=0.05")
    from kvstored_client.contract.proto import kvstored_pb2 as pb

    with kvstored.Client(d.socket) as c:
        c.save(np.arange(32), rows(2))
        ns_id = c._ns(None)[0]
        resp = c._stub.Lookup(pb.LookupRequest(namespace_id=ns_id, lease=True, session_id=c._session(),
                                               keys=pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(32)))))
        assert resp.hit_blocks == 2
        time.sleep(0.6)
        with pytest.raises(kvstored.LeaseExpired, match="expired"):
            c._call(c._stub.Release, pb.ReleaseRequest(session_id=c._session(), lease_id=resp.lease_id))
        assert int(c.stats()["active_leases"]) == 0


def test_session_survives_daemon_restart(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """README: a daemon that is gone is DaemonNotRunning, and a client lives through a daemon
    restart: its next call opens a new session (the blocks SIGTERM wrote to SSD are still there).
    Was: an engine that kept calling while the daemon restarted (8 s here) stretched gRPC's
    reconnect backoff, and the same client kept failing with DaemonNotRunning for about as long
    again after the daemon was back (up to two minutes after a longer outage)."""
    from conftest import wait_serving

    d = daemon_factory()
    c = kvstored.Client(d.socket)
    kv = rows(2)
    c.save(np.arange(32), kv)
    assert d.stop() == 0
    down_until = time.monotonic() + 8
    while time.monotonic() < down_until:   # the engine keeps trying meanwhile
        with pytest.raises(kvstored.DaemonNotRunning):
            c.lookup(np.arange(32))
        time.sleep(0.1)
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(d.args, stdout=log, stderr=subprocess.STDOUT)
    wait_serving(d.socket, d.proc)
    back_by = time.monotonic() + 2          # the SDK retries the socket at least every second
    while True:
        try:
            hit = c.lookup(np.arange(32))    # the same client, a new daemon
            break
        except kvstored.DaemonNotRunning:
            assert time.monotonic() < back_by, "the client still fails 2 s after the daemon is back"
            time.sleep(0.05)
    assert hit.blocks == 2
    assert np.array_equal(c.load(np.arange(32)).data, kv)
    assert c.save(np.arange(100, 132), rows(2, seed=1)).stored == 2
    c.close()


def test_unregister_during_copy_waits_for_it(client) -> None:  # type: ignore[no-untyped-def]
    """Unregister is a handshake: it returns only after the daemon's copies into the buffers are
    done and the buffers are unmapped, so the engine may free them at once."""
    layers = [kvstored.shm.empty((2, 64, 16, 8, 64), "float16") for _ in range(8)]  # 32 MiB in all
    for i, t in enumerate(layers):
        t.numpy()[...] = i + 1
    ns = Namespace(model="unregister-during-copy", kv_dtype="float16")
    src = client.register_buffers([t.numpy() for t in layers], 1, namespace=ns)
    tokens = list(range(16 * 64))
    assert client.save_blocks(src, list(range(64)), tokens).stored == 64
    dst_layers = [kvstored.shm.empty((2, 64, 16, 8, 64), "float16") for _ in range(8)]
    dst = client.register_buffers([t.numpy() for t in dst_layers], 1, namespace=ns)
    handle = client.load_blocks(dst, list(range(64)), tokens, wait=False)
    # once the daemon has started copying (two calls on one channel may reach it in either order)
    assert handle.result().blocks == 64
    client.unregister_buffers(dst)
    # when unregister returns, every copy into the buffers is over: the bytes are all there,
    # before the load's own end is read
    for i, t in enumerate(dst_layers):
        assert (t.numpy() == i + 1).all(), f"layer {i} was still being copied when unregister returned"
    assert handle.wait(timeout=60).blocks == 64  # the copy was not cut short
    for t in dst_layers:
        t.close()  # the engine frees its memory; the daemon no longer maps it
    assert client.stats()["clients"] >= 1
    with pytest.raises(kvstored.NotFound):
        client.load_blocks(dst, [0], tokens[:16])


def test_keys_go_packed_to_a_daemon_that_takes_them_and_repeated_to_one_that_does_not(client) -> None:  # type: ignore[no-untyped-def]
    """A daemon from before packed keys ignores packed_hashes/packed_block_ids (it would store and
    find nothing): the SDK sends them only when Hello says the daemon takes them. Block ids may be
    a numpy array (was: stream() failed on its truth value)."""
    assert client._hello.packed_keys and client._packed_keys, "this daemon takes packed keys"
    sent: list[object] = []

    def recording(call):  # type: ignore[no-untyped-def]
        def record(request, *args, **kwargs):  # type: ignore[no-untyped-def]
            sent.append(request)
            return call(request, *args, **kwargs)
        return record

    for name in ("SaveBlocks", "LoadBlocks", "Lookup", "StreamBlocks"):
        setattr(client._stub, name, recording(getattr(client._stub, name)))
    src = kvstored.shm.empty((8, 2, 16, 2, 8), "float16")
    src.numpy()[...] = np.random.default_rng(5).standard_normal(src.shape).astype(np.float16)
    dst = kvstored.shm.empty((8, 2, 16, 2, 8), "float16")
    ns = Namespace(model="old-daemon", kv_dtype="float16")
    b_src = client.register_buffers([src.numpy()], 0, namespace=ns)
    b_dst = client.register_buffers([dst.numpy()], 0, namespace=ns)
    for packed, tokens in ((False, np.arange(48)), (True, np.arange(1000, 1048))):
        client._packed_keys = packed
        sent.clear()
        assert client.save_blocks(b_src, np.array([5, 1, 3]), tokens).stored == 3
        assert client.lookup(tokens, namespace=b_src.namespace).blocks == 3
        assert client.load_blocks(b_dst, [0, 1, 2], tokens).blocks == 3
        assert [a.index for a in client.stream(tokens, buffers=b_dst, block_ids=np.array([4, 6, 7]))] == [0, 1, 2]
        for i, j in zip([5, 1, 3], [0, 1, 2]):
            assert np.array_equal(src.numpy()[i], dst.numpy()[j])
        for i, j in zip([5, 1, 3], [4, 6, 7]):
            assert np.array_equal(src.numpy()[i], dst.numpy()[j])
        # (a plain lookup answered from the presence table sends its request one-way, not by the stub)
        assert len(sent) == (3 if packed and client.lookup_transport == "table" else 4)
        for request in sent:
            keys = request.keys  # type: ignore[attr-defined]
            assert (bool(keys.packed_hashes), len(keys.hashes)) == ((True, 0) if packed else (False, 3)), request
            if hasattr(request, "packed_block_ids"):
                ids = request.packed_block_ids if packed else request.block_ids  # type: ignore[attr-defined]
                assert len(ids) == (12 if packed else 3), request
        dst.numpy()[...] = 0


def test_leaving_a_stream_into_buffers_early_returns_once_the_daemon_copies_no_more(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """An engine that stops reading a stream (the request was aborted) reuses the blocks that did
    not arrive. Cancelling the call alone let the daemon go on copying further blocks into them
    for a while; leaving the loop now returns only once the daemon has stopped (EndStream)."""
    d = daemon_factory("--dram-capacity", "512MiB", "--set", "dram.page_bytes=32MiB")
    n, width = 256, 512 * 1024   # 256 blocks of 1 MiB (float16)
    ns = Namespace(model="leave-early", kv_dtype="float16")
    with kvstored.Client(d.socket) as c:
        src = kvstored.shm.empty((n, width), "float16")
        dst = kvstored.shm.empty((n, width), "float16")
        try:
            src.numpy()[...] = np.arange(1, n + 1, dtype=np.float16)[:, None]
            b_src = c.register_buffers([src.numpy()], 0, namespace=ns)
            b_dst = c.register_buffers([dst.numpy()], 0, namespace=ns)
            tokens = np.arange(n * ns.block_size)
            assert c.save_blocks(b_src, list(range(n)), tokens).stored == n

            def copied() -> int:
                return sum(bool(dst.numpy()[i, 0] == i + 1) for i in range(n))

            for arrival in c.stream(tokens, buffers=b_dst, block_ids=list(range(n)), peers=False):
                assert arrival.index == 0
                break
            at_exit = copied()
            time.sleep(0.3)
            assert copied() == at_exit, (f"{copied() - at_exit} more blocks were copied into the engine's "
                                         f"buffers after it left the stream ({at_exit} at the exit)")
            assert at_exit < n, "the daemon copied the whole prompt before the first arrival"
            # the client and daemon go on as usual
            assert c.load_blocks(b_dst, list(range(n)), tokens).blocks == n
            assert copied() == n
        finally:
            src.close()
            dst.close()


def test_end_stream_is_used_only_with_a_daemon_that_takes_it(client) -> None:  # type: ignore[no-untyped-def]
    """A daemon from before EndStream ignores stream_id: the SDK names streams (and calls
    EndStream when it leaves one early) only when Hello says the daemon takes it."""
    assert client._hello.end_stream and client._takes_end_stream
    sent: list[object] = []
    for name in ("StreamBlocks", "EndStream"):
        real = getattr(client._stub, name)

        def record(request, *args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            sent.append((_name, request))
            return _real(request, *args, **kwargs)
        setattr(client._stub, name, record)
    engine = kvstored.shm.empty((4, 2, 16, 2, 8), "float16")
    ns = Namespace(model="end-stream", kv_dtype="float16")
    try:
        b = client.register_buffers([engine.numpy()], 0, namespace=ns)
        tokens = np.arange(64)
        assert client.save_blocks(b, [0, 1, 2, 3], tokens).stored == 4
        for takes in (True, False):
            client._takes_end_stream = takes
            sent.clear()
            for _ in client.stream(tokens, buffers=b, block_ids=[0, 1, 2, 3], peers=False):
                break
            names = [n for n, _ in sent]
            stream_id = sent[0][1].stream_id  # type: ignore[attr-defined]
            assert (names, stream_id != 0) == ((["StreamBlocks", "EndStream"], True) if takes
                                               else (["StreamBlocks"], False)), (takes, names, stream_id)
    finally:
        engine.close()


def test_save_and_load_from_a_block_on(client) -> None:  # type: ignore[no-untyped-def]
    """An engine that holds a chain's first blocks gives and takes only the rest (``start``)."""
    chain = kvstored.block_hashes(list(range(16 * 8)), block_size=16)
    kv = rows(8, seed=3)
    assert client.save(None, kv[:5], hashes=chain[:5]).stored == 5
    tail = client.save(None, kv[5:], hashes=chain, start=5)
    assert (tail.present, tail.stored) == (5, 3)
    got = client.load(hashes=chain, start=6)
    assert got.blocks == 8 and np.array_equal(got.data, kv[6:])
    out = np.zeros((4, 1024), np.uint8)
    got = client.load(hashes=chain, start=5, out=out)
    assert got.blocks == 8 and np.array_equal(out[:3], kv[5:]) and not out[3].any()
    past = client.load(hashes=chain[:4], start=6)
    assert past.blocks == 4 and past.data.shape == (0, 1024)


def test_a_tail_whose_leading_blocks_are_not_cached_is_not_stored(client) -> None:  # type: ignore[no-untyped-def]
    chain = kvstored.block_hashes(list(range(500, 500 + 16 * 6)), block_size=16)
    client.save(None, rows(2, seed=4), hashes=chain[:2])
    refused = client.save(None, rows(2, seed=5), hashes=chain[:6], start=4)
    assert (refused.present, refused.stored) == (2, 0)
    assert client.lookup(hashes=chain).blocks == 2      # no block stored behind rows nobody gave
    with pytest.raises(kvstored.InvalidArgument):
        client.save(None, rows(2), hashes=chain, start=-1)
    with pytest.raises(kvstored.InvalidArgument):
        client.load(hashes=chain, start=1.5)  # type: ignore[arg-type]
    with pytest.raises(kvstored.InvalidArgument):
        client.save(None, rows(1), hashes=chain[:6], start=2)   # 4 blocks from start, 1 row


def test_a_packed_lookup_reply_says_what_the_repeated_fields_say(client) -> None:  # type: ignore[no-untyped-def]
    """The SDK asks for tiers and offsets packed as bytes (LookupRequest.packed_reply); a client that
    does not ask (an SDK from before) still gets the repeated fields, the same values."""
    from kvstored_client.contract.proto import kvstored_pb2 as pb

    tokens = np.arange(16 * 5)
    kv = rows(5, 512)
    client.save(tokens, kv)
    assert client.lookup(tokens).per_tier == {"dram": 5}
    assert np.array_equal(client.load(tokens).data, kv)
    session, ns = client._session(), client._ns(None)[0]
    answers = {}
    for packed in (False, True):
        request = pb.LookupRequest(namespace_id=ns, lease=True, session_id=session, packed_reply=packed,
                                   keys=pb.BlockKeys(token_ids=tokens.tolist()))
        answers[packed] = client._call(client._stub.Lookup, request)
        client._call(client._stub.Release, pb.ReleaseRequest(session_id=session, lease_id=answers[packed].lease_id))
    plain, packed_reply = answers[False], answers[True]
    assert not plain.packed_tiers and not plain.packed_offsets and not packed_reply.tiers and not packed_reply.offsets
    assert list(np.frombuffer(packed_reply.packed_tiers, np.uint8)) == list(plain.tiers) == [pb.TIER_DRAM] * 5
    assert list(np.frombuffer(packed_reply.packed_offsets, "<u8")) == list(plain.offsets)
