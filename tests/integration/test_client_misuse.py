"""The SDK under misuse and daemon trouble: typed errors, nothing left leased, bounded waits,
a daemon restart under a live client. Each test is a bug a review found (regressions)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import kvstored
from conftest import Daemon, wait_serving
from kvstored import Namespace
from kvstored_client.contract.proto import kvstored_pb2 as pb


def rows(n: int, width: int = 4096, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 255, size=(n, width), dtype=np.uint8)


def active_leases(c: kvstored.Client) -> int:
    c._settle_releases()   # the SDK sends releases in the background
    return int(c.stats()["active_leases"])


def restart(d: Daemon) -> Daemon:
    """Stop ``d`` and start the same daemon again (same socket, same SSD directory)."""
    d.stop()
    with open(d.log_path, "ab") as log:
        proc = subprocess.Popen(d.args, stdout=log, stderr=subprocess.STDOUT)
    d.proc = proc
    wait_serving(d.socket, proc)
    return d


def test_a_client_follows_a_daemon_restart(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Was: the client kept writing into the old daemon's (deleted) arena file after a restart,
    so its saves stored zeros and its loads read stale bytes, with no error."""
    d = daemon_factory()
    c = kvstored.Client(d.socket)
    c.save(np.arange(32), rows(2, seed=1))
    restart(d)
    deadline = time.monotonic() + 10
    while c._session_id is not None and time.monotonic() < deadline:   # the session's end is noticed
        time.sleep(0.02)
    mine = rows(2, seed=2)
    assert c.save(np.arange(1000, 1032), mine).stored == 2
    with kvstored.Client(d.socket) as fresh:
        assert np.array_equal(fresh.load(np.arange(1000, 1032)).data, mine)
        theirs = rows(2, seed=3)
        fresh.save(np.arange(2000, 2032), theirs)
    assert np.array_equal(c.load(np.arange(2000, 2032)).data, theirs)
    c.close()


def test_whether_the_daemon_takes_packed_keys_is_renewed_with_each_session(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Was: read from the first Hello only, so a daemon restarted as another version (one that
    ignores packed keys) saw no keys from this client: every save and lookup did nothing."""
    d = daemon_factory()
    c = kvstored.Client(d.socket)
    c.save(np.arange(32), rows(2, seed=1))
    c._packed_keys = False          # as if the daemon first met had been one from before
    restart(d)
    deadline = time.monotonic() + 10
    while c._session_id is not None and time.monotonic() < deadline:   # the session's end is noticed
        time.sleep(0.02)
    assert c.save(np.arange(1000, 1032), rows(2, seed=2)).stored == 2
    assert c._packed_keys, "the new session's first event says the daemon takes packed keys"
    c.close()


def test_flat_kv_is_refused_and_the_namespace_stays_usable(client) -> None:  # type: ignore[no-untyped-def]
    """Was: a 1-D ``kv`` was stored as one-byte blocks and fixed the namespace's size at 1 byte."""
    kv = rows(20)
    with pytest.raises(kvstored.InvalidArgument, match="one row per block"):
        client.save(np.arange(320), kv.ravel())
    assert client.save(np.arange(320), kv).stored == 20
    assert np.array_equal(client.load(np.arange(320)).data, kv)


def test_a_frozen_daemon_gives_deadline_errors_not_hangs(daemon) -> None:  # type: ignore[no-untyped-def]
    """Was: the first call needing a session, and ``migrate``, waited forever on a stopped daemon."""
    c = kvstored.Client(daemon.socket, timeout_s=1.0, namespace=Namespace(model="frozen", block_bytes=4096))
    c.lookup(np.arange(32))   # the namespace is known (its size too), no session yet
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(kvstored.DeadlineExceeded, match="did not open a session within 1 s"):
            c.load(np.arange(32))
        with pytest.raises(kvstored.DeadlineExceeded, match="no progress of the migration"):
            list(c.migrate("elsewhere"))
        with pytest.raises(kvstored.DeadlineExceeded, match=daemon.socket):
            c.stats()
        assert time.monotonic() - t0 < 20
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert c.load(np.arange(32)).blocks == 0   # and the client works once the daemon does
    c.close()


def test_leaving_a_stream_early_releases_its_lease(client) -> None:  # type: ignore[no-untyped-def]
    """Was: the daemon had handed the stream's lease to an end event the client never read, so
    the blocks stayed pinned until the lease expired (30 s)."""
    ns = Namespace(model="early-exit")
    tokens = np.arange(16 * 20)
    client.save(tokens, rows(20), namespace=ns)
    stream = client.stream(tokens, namespace=ns)
    for _ in stream:
        break
    evicted, deadline = 0, time.monotonic() + 5   # well inside the 30 s lease
    while evicted < 20 and time.monotonic() < deadline:
        evicted += client.evict(model="early-exit")
        time.sleep(0.05)
    assert evicted == 20 and active_leases(client) == 0


def test_waiting_on_a_closed_stream_is_an_sdk_error(client) -> None:  # type: ignore[no-untyped-def]
    """Was: wait() after close() ended in AssertionError("a stream ended without its outcome"),
    which no `except KVStoreError` catches."""
    ns = Namespace(model="closed-stream")
    tokens = np.arange(16 * 4)
    client.save(tokens, rows(4), namespace=ns)
    stream = client.stream(tokens, namespace=ns)
    stream.close()
    with pytest.raises(kvstored.KVStoreError, match="closed before its end"):
        stream.wait()


def test_threads_sharing_a_client_release_every_lease(client) -> None:  # type: ignore[no-untyped-def]
    """Was: concurrent loads rebuilt the list of pending releases without a lock; dropped
    release futures were cancelled by grpc and their leases held until expiry."""
    tokens = np.arange(128)
    kv = rows(8, 1024)
    client.save(tokens, kv)

    def loads(_: int) -> bool:
        return all(np.array_equal(client.load(tokens).data, kv) for _ in range(40))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(loads, range(8)))
    assert active_leases(client) == 0 and client.evict() == 8


def test_a_load_that_fails_keeps_nothing_leased(client) -> None:  # type: ignore[no-untyped-def]
    """Was: a bad ``out`` or ``dtype`` raised after the leasing lookup and left the lease held."""
    client.save(np.arange(64), rows(4, 256))
    read_only = np.empty((4, 256), np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(kvstored.InvalidArgument, match="read-only"):
        client.load(np.arange(64), out=read_only)
    with pytest.raises(kvstored.InvalidArgument, match="need 4 rows"):
        client.load(np.arange(64), out=np.empty((2, 256), np.uint8))
    with pytest.raises(kvstored.InvalidArgument, match="whole number"):
        client.load(np.arange(64), dtype=np.dtype("V3"))
    with pytest.raises(kvstored.InvalidArgument, match="dtype"):
        client.load(np.arange(64), dtype="no-such-type")
    assert active_leases(client) == 0


def test_a_miss_into_out_is_an_empty_result(client) -> None:  # type: ignore[no-untyped-def]
    """Was: InvalidArgument ('need 0 rows of 0 bytes') in a namespace with nothing saved yet."""
    res = client.load(np.arange(32), out=np.empty((2, 64), np.uint8), namespace=Namespace(model="empty"))
    assert (res.blocks, res.tokens, res.data.shape) == (0, 0, (0, 64))


def test_misuse_raises_typed_errors_that_say_what_is_wrong(client) -> None:  # type: ignore[no-untyped-def]
    tokens = np.arange(48)
    with pytest.raises(kvstored.InvalidArgument, match="sequence of bytes"):
        client.lookup(hashes="ab" * 16)   # type: ignore[arg-type]
    with pytest.raises(kvstored.InvalidArgument, match="sequence of bytes"):
        client.lookup(hashes=[1, 2])   # type: ignore[list-item]
    with pytest.raises(kvstored.InvalidArgument, match="block_bytes must not be negative"):
        client.lookup(tokens, namespace=Namespace(model="m", block_bytes=-1))
    with pytest.raises(kvstored.InvalidArgument, match="not object"):
        client.save(tokens, np.array([[object()] * 4] * 3))
    layers = [kvstored.shm.empty((2, 8, 16, 2, 8), "float16") for _ in range(2)]
    bufs = client.register_buffers([t.numpy() for t in layers], 1, namespace=Namespace(model="ids"))
    assert bufs.num_tensors == 2
    for bad in (-1, 8, 2**32, 1.5):
        with pytest.raises(kvstored.InvalidArgument, match=r"block_ids\[1\]"):
            client.save_blocks(bufs, [0, bad, 2], tokens)   # type: ignore[list-item]
    client.save_blocks(bufs, [0, 1, 2], tokens)
    handle = client.load_blocks(bufs, [3, 4, 5], tokens, wait=False)
    with pytest.raises(kvstored.InvalidArgument, match="tensor 9 is not one of the 2"):
        handle.wait_layer(9)
    assert handle.wait(timeout=30).blocks == 3
    client.close()
    client.close()   # twice: nothing happens
    with pytest.raises(kvstored.ClientClosed, match="closed"):
        client.lookup(tokens)
    with pytest.raises(kvstored.ClientClosed):
        client.stats()


def test_session_wait_does_not_block_other_threads_forever(daemon) -> None:  # type: ignore[no-untyped-def]
    """While one thread waits (bounded) for a session of a frozen daemon, the others give up
    within their own timeout too."""
    c = kvstored.Client(daemon.socket, timeout_s=0.5, namespace=Namespace(model="frozen", block_bytes=4096))
    c.lookup(np.arange(32))   # the namespace is known (its size too): the threads go straight to the session
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    errors: list[BaseException] = []
    took: list[float] = []

    def call() -> None:
        t0 = time.monotonic()
        try:
            c.load(np.arange(32))
        except BaseException as exc:
            errors.append(exc)
        took.append(time.monotonic() - t0)

    try:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        assert len(errors) == 3 and all(isinstance(e, kvstored.DeadlineExceeded) for e in errors)
        # each within its own timeout, not one after another (a review found 0.5, 1.0, 1.5 s)
        assert max(took) < 1.5, took
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    c.close()


def test_a_miss_has_rows_as_wide_as_the_blocks(client) -> None:  # type: ignore[no-untyped-def]
    """Was (during the review's fixes): a miss returned a (0, 0) array where callers compare with
    ``kv[:0]`` of shape (0, block bytes)."""
    client.save(np.arange(32), rows(2))
    assert client.load(np.arange(5000, 5032)).data.shape == (0, 4096)
    assert client.load(np.arange(5000, 5032), dtype=np.float32).data.shape == (0, 1024)


def test_a_failed_reconnect_never_leaves_the_old_arena_in_use(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression (code review): after a lost session, a reconnect that failed half-way (the old
    daemon answered, then hung) left the client mapping the old daemon's arena; its next session
    on a new daemon wrote there, and other clients loaded wrong bytes. Each session's first event
    now names its daemon's arena."""
    from conftest import start_daemon

    x = start_daemon(tmp_path / "d")
    c = kvstored.Client(x.socket, timeout_s=1.0)
    try:
        c.save(np.arange(32), rows(2, seed=1))
        c._session_call.cancel()   # the session stream breaks while the daemon lives
        deadline = time.monotonic() + 10
        while c._session_id is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        real_session = c._stub.Session

        def answer_then_hang(*args, **kwargs):  # type: ignore[no-untyped-def]
            os.kill(x.proc.pid, signal.SIGSTOP)   # the old daemon hangs as the session opens
            return real_session(*args, **kwargs)

        c._stub.Session = answer_then_hang
        with pytest.raises(kvstored.DeadlineExceeded):
            c.save(np.arange(64), rows(4, seed=2))
        c._stub.Session = real_session
        x.stop(signal.SIGKILL)
        z = start_daemon(tmp_path / "d")      # a new daemon on the same socket
        try:
            kv = rows(4, seed=3)
            assert c.save(np.arange(64, 128), kv).stored == 4
            with kvstored.Client(z.socket) as other:
                assert np.array_equal(other.load(np.arange(64, 128)).data, kv)
        finally:
            z.stop()
    finally:
        c.close()


def test_a_slow_stream_reader_is_told_its_bytes_may_be_another_blocks(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """client.stream() without buffers copies each block out of the arena only when the loop asks
    for the next arrival, and never checked that the stream's lease was still held: a reader slower
    than leases.ttl_s got bytes of whatever now occupies the slot, silently. README: the loop
    "ends with LeaseExpired if the loop ran longer than the lease" (as client.load does)."""
    d = daemon_factory("--set", "leases.ttl_s=0.5", "--set", "leases.reap_interval_s=0.05")
    c = kvstored.Client(d.socket)
    other = kvstored.Client(d.socket)
    try:
        ns = Namespace(model="slow-stream")
        tokens = np.arange(16 * 4)
        kv = rows(4, seed=1)
        c.save(tokens, kv, namespace=ns)
        got: list[np.ndarray] = []
        with pytest.raises(kvstored.LeaseExpired, match="read after its lease ended"):
            for arrival in c.stream(tokens, namespace=ns, peers=False):
                got.append(arrival.data)
                if arrival.index == 0:
                    time.sleep(1.0)                    # the engine is busy; the lease runs out
                    assert other.evict(model="slow-stream") == 4   # nothing pins them any more
                    other.save(np.arange(10_000, 10_000 + 16 * 4), np.full((4, 4096), 0xEE, np.uint8),
                               namespace=ns)           # takes the freed slots
        assert len(got) == 4
        assert np.array_equal(got[0], kv[0])   # copied while the lease held: the right bytes
    finally:
        other.close()
        c.close()


def test_a_save_interrupted_while_writing_the_arena_gives_its_reservation_back(daemon, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C (or a bad row) between Reserve and Seal: the reservation was held until it expired
    (a minute), and every other writer of that prompt was told its blocks were being written."""
    from kvstored_client import client as sdk_client

    real_copy = sdk_client.copy_rows

    def interrupted(arena: np.ndarray, offsets: Any, rows: np.ndarray, to_arena: bool) -> None:
        real_copy(arena, offsets[:1], rows[:1], to_arena)   # the first block is written, then Ctrl-C
        raise KeyboardInterrupt

    tokens, kv = np.arange(16 * 4), rows(4, seed=3)
    with kvstored.Client(daemon.socket) as c, kvstored.Client(daemon.socket) as other:
        monkeypatch.setattr(sdk_client, "copy_rows", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.save(tokens, kv)
        monkeypatch.setattr(sdk_client, "copy_rows", real_copy)
        assert other.save(tokens, kv).stored == 4   # not "being written by another client"
        assert np.array_equal(other.load(tokens).data, kv)
        assert active_leases(other) == 0   # (the load released in the background: settled first)


def test_load_blocks_without_waiting_racing_close_is_client_closed(daemon, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """close() from another thread while load_blocks(wait=False) is past its checks: was a raw
    ValueError from grpc ("Cannot invoke RPC on closed channel")."""
    from kvstored_client import coerce

    c = kvstored.Client(daemon.socket)
    buf = kvstored.shm.empty((4, 2, 16, 2, 8), "float16")
    real = coerce.set_block_ids

    def closing_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        c.close()
        return real(*args, **kwargs)

    try:
        b = c.register_buffers([buf.numpy()], 0, namespace=Namespace(model="closed", kv_dtype="float16"))
        monkeypatch.setattr(coerce, "set_block_ids", closing_meanwhile)
        with pytest.raises(kvstored.ClientClosed):
            c.load_blocks(b, [0], np.arange(16), wait=False)
    finally:
        buf.close()


@pytest.mark.parametrize("call", ["migrate", "pull"])
def test_a_streaming_call_racing_close_is_client_closed(daemon, monkeypatch, call) -> None:  # type: ignore[no-untyped-def]
    """close() from another thread while migrate or pull is past its checks. Found by
    tests/integration/test_cluster_random.py (seed 12): migrate raised grpc's raw ValueError
    ("Cannot invoke RPC: Channel closed!")."""
    c = kvstored.Client(daemon.socket)
    step = "_settle_releases" if call == "migrate" else "_keys"   # its last step before the RPC
    real = getattr(c, step)

    def closing_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        got = real(*args, **kwargs)
        monkeypatch.setattr(c, step, real)   # (close may take that step too)
        c.close()
        return got

    monkeypatch.setattr(c, step, closing_meanwhile)
    with pytest.raises(kvstored.ClientClosed):
        if call == "migrate":
            list(c.migrate(to="nobody", model="m"))
        else:
            c.pull(np.arange(32))


def test_a_prompt_of_no_whole_block_saves_with_an_empty_kv(client) -> None:  # type: ignore[no-untyped-def]
    """Was: a kv (or out) of 0 rows raised numpy's ValueError / torch's RuntimeError ("cannot
    reshape ... of size 0"), not an SDK error, although such a prompt has no block to store."""
    import torch

    assert client.save(np.arange(5), np.empty((0, 4096), np.uint8)) == kvstored.SaveResult(0, 0, 16)
    assert client.save([], torch.empty((0, 8, 256), dtype=torch.bfloat16)).stored == 0
    assert client.load([], out=np.empty((0, 4096), np.uint8)).data.shape == (0, 4096)
    client.save(np.arange(32), rows(2))
    with pytest.raises(kvstored.InvalidArgument, match="need 2 rows"):
        client.load(np.arange(32), out=np.empty((0, 4096), np.uint8))
    assert active_leases(client) == 0


def test_a_client_without_a_session_follows_a_daemon_restart(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A router that only calls lookup (no session, so no session end to notice) kept the old
    daemon's namespace id: after a restart of a daemon that did not persist the namespace every
    lookup raised NotFound("unknown namespace ...: open it first"), for as long as the client
    lived. README: "A client lives through a daemon restart"."""
    d = daemon_factory("--set", "ssd.enabled=false")
    ns = Namespace(model="router", block_bytes=4096)
    c = kvstored.Client(d.socket, namespace=ns)
    try:
        assert c.lookup(np.arange(32)).blocks == 0
        restart(d)
        assert c.lookup(np.arange(32)).blocks == 0
        assert c.prefetch(np.arange(32)).blocks == 0
        with kvstored.Client(d.socket, namespace=ns) as other:
            other.save(np.arange(32), rows(2))
        assert c.lookup(np.arange(32)).blocks == 2
    finally:
        c.close()


def test_an_interrupted_session_open_leaves_no_session_behind(daemon, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C while the first call waited for its session: the session stream stayed open (the
    daemon counted a client, two SDK threads stayed), and the next call opened a second one."""
    import queue

    import kvstored_client.connection as connection_mod

    class Interrupted(queue.Queue):   # type: ignore[type-arg]
        def get(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

    with kvstored.Client(daemon.socket) as c:
        monkeypatch.setattr(connection_mod.queue, "Queue", Interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.save(np.arange(32), rows(2))
        monkeypatch.undo()
        clients, deadline = 1, time.monotonic() + 10
        while clients and time.monotonic() < deadline:
            clients = c.stats()["clients"]
            time.sleep(0.02)
        assert clients == 0
        assert c.save(np.arange(32), rows(2)).stored == 2
        assert c.stats()["clients"] == 1


def test_a_save_interrupted_during_its_seal_gives_its_reservation_back(daemon) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C (or a deadline) in the Seal call: the reservation was held until it expired, and
    every other writer of the prompt was told its blocks were being written (stored 0)."""
    tokens, kv = np.arange(16 * 4), rows(4, seed=5)
    with kvstored.Client(daemon.socket) as c, kvstored.Client(daemon.socket) as other:
        def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

        c._stub.Seal = interrupted
        with pytest.raises(KeyboardInterrupt):
            c.save(tokens, kv)
        c._settle_releases()
        assert other.save(tokens, kv).stored == 4
        assert np.array_equal(other.load(tokens).data, kv)
        # other's load sends its release in the background: settle it, not c's (a flaky CI run)
        assert active_leases(other) == 0


def test_a_stream_whose_namespace_size_was_fixed_meanwhile_carries_whole_blocks(daemon) -> None:  # type: ignore[no-untyped-def]
    """stream() without buffers copied each block with the block size the namespace had when the
    call started: when another client's first save (or a peer's push) fixed it between that and
    the daemon's lookup, every arrival carried 0 bytes, and the outcome said "complete"."""
    ns = Namespace(model="sized-meanwhile")
    tokens, kv = np.arange(16 * 3), rows(3, seed=7)
    with kvstored.Client(daemon.socket) as c, kvstored.Client(daemon.socket) as other:
        real_open = c._stub.OpenNamespace

        def open_then_other_saves(request, **kwargs):  # type: ignore[no-untyped-def]
            resp = real_open(request, **kwargs)
            if request.spec.model == "sized-meanwhile" and not resp.spec.block_bytes:
                other.save(tokens, kv, namespace=ns)   # the first save lands just after our answer
            return resp

        c._stub.OpenNamespace = open_then_other_saves
        stream = c.stream(tokens, namespace=ns, peers=False)
        got = [arrival.data for arrival in stream]
        assert stream.outcome is not None and stream.outcome.complete
        assert len(got) == 3 and all(np.array_equal(g, row) for g, row in zip(got, kv))


def test_registered_buffers_live_through_a_daemon_restart(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Was: a registration belonged to the session that made it, so after `systemctl restart
    kvstored` every save_blocks/load_blocks of an engine raised NotFound("unknown buffers") until
    the engine registered its buffers again, which engines that register once at start never do.
    The SDK now registers them again with the new daemon on their next use."""
    d = daemon_factory("--set", "ssd.enabled=false")
    ns = Namespace(model="reregister", kv_dtype="float16")
    engine = kvstored.shm.empty((8, 2, 16, 2, 8), "float16")   # 8 blocks of 16 tokens
    kv = engine.numpy()
    kv[...] = np.random.default_rng(3).standard_normal(kv.shape).astype(np.float16)
    c = kvstored.Client(d.socket)
    try:
        buffers = c.register_buffers([kv], 0, namespace=ns)
        assert c.save_blocks(buffers, [0, 1], np.arange(32)).stored == 2
        restart(d)
        deadline = time.monotonic() + 10
        while c._session_id is not None and time.monotonic() < deadline:   # the session's end is noticed
            time.sleep(0.02)
        # the same Buffers object, a new daemon: save two blocks, load them into two other slots
        assert c.save_blocks(buffers, [2, 3], np.arange(1000, 1032)).stored == 2
        registered_as = buffers.buffers_id
        kv[4:6] = 0
        assert c.load_blocks(buffers, [4, 5], np.arange(1000, 1032)).blocks == 2
        assert np.array_equal(kv[4:6], kv[2:4])
        kv[6:8] = 0
        stream = c.stream(np.arange(1000, 1032), buffers=buffers, block_ids=[6, 7])
        assert stream.wait().blocks == 2
        assert np.array_equal(kv[6:8], kv[2:4])
        assert buffers.buffers_id == registered_as, "registered again once, not per call"
        c.unregister_buffers(buffers)
        with pytest.raises(kvstored.NotFound, match="unknown buffers"):   # the daemon let them go
            c._call(c._stub.LoadBlocks, pb.LoadBlocksRequest(
                session_id=c._session(), namespace_id=c._ns(buffers.namespace)[0], buffers_id=registered_as,
                keys=pb.BlockKeys(hashes=kvstored.block_hashes(np.arange(1000, 1032))), block_ids=[4, 5]))
        with pytest.raises(kvstored.NotFound, match="unregistered"):
            c.save_blocks(buffers, [0], np.arange(2000, 2016))
    finally:
        c.close()
        engine.close()


def test_unregistering_buffers_of_a_session_that_ended_is_quiet(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Buffers registered before a daemon restart and unregistered after it: the daemon dropped
    them with the session, so there is nothing to refuse (was: NotFound on shutdown paths)."""
    d = daemon_factory("--set", "ssd.enabled=false")
    engine = kvstored.shm.empty((4, 2, 16, 2, 8), "float16")
    c = kvstored.Client(d.socket)
    try:
        buffers = c.register_buffers([engine.numpy()], 0, namespace=Namespace(model="unreg", kv_dtype="float16"))
        restart(d)
        c.unregister_buffers(buffers)            # whether or not the session's end was noticed yet
        c.unregister_buffers(buffers)            # twice: nothing
        with pytest.raises(kvstored.NotFound, match="unregistered"):
            c.load_blocks(buffers, [0], np.arange(16))
        with kvstored.Client(d.socket) as other, pytest.raises(kvstored.InvalidArgument, match="another client"):
            other.load_blocks(buffers, [0], np.arange(16))
    finally:
        c.close()
        engine.close()


def test_engine_threads_reregistering_after_a_restart_time_out_each_on_its_own(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Was: the thread registering buffers again after a restart held a client-wide lock across
    its RPC, so with the daemon frozen, engine threads (even with other buffers) waited for each
    other's timeout_s in turn: the last of four gave DeadlineExceeded after 4 x timeout_s."""
    d = daemon_factory("--set", "ssd.enabled=false")
    ns = Namespace(model="reregister-frozen", kv_dtype="float16")
    engines = [kvstored.shm.empty((8, 2, 16, 2, 8), "float16") for _ in range(2)]
    c = kvstored.Client(d.socket, timeout_s=1.0)
    try:
        buffers = [c.register_buffers([e.numpy()], 0, namespace=ns) for e in engines]
        restart(d)
        deadline = time.monotonic() + 10
        while c._session_id is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        # buffers[1] registered again with the new daemon (which fixes the namespace's block size
        # there), buffers[0] not yet: what is left to do for it is registering again
        assert c.save_blocks(buffers[1], [0], np.arange(9000, 9016)).stored == 1
        c._ns(buffers[0].namespace)
        os.kill(d.proc.pid, signal.SIGSTOP)
        took: list[float] = []
        errors: list[BaseException] = []

        def save(i: int) -> None:
            t0 = time.monotonic()
            try:
                c.save_blocks(buffers[i % 2], [i], np.arange(16 * i, 16 * i + 16))
            except kvstored.DeadlineExceeded:
                pass
            except BaseException as exc:
                errors.append(exc)
            took.append(time.monotonic() - t0)

        try:
            threads = [threading.Thread(target=save, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert not errors, errors
        assert len(took) == 6 and max(took) < 2.5, took
        assert c.save_blocks(buffers[0], [0], np.arange(5000, 5016)).stored == 1   # and then it works
    finally:
        c.close()
        for e in engines:
            e.close()


def test_a_stream_cut_by_closing_its_client_raises_client_closed(daemon) -> None:  # type: ignore[no-untyped-def]
    """Was: closing the client (from another thread) cancelled the stream's call and the loop
    just ended: no arrivals, no error, ``outcome`` None, as if the caller had closed the stream."""
    c = kvstored.Client(daemon.socket)
    tokens = np.arange(16 * 4)
    c.save(tokens, rows(4))
    stream = c.stream(tokens)
    c.close()
    with pytest.raises(kvstored.ClientClosed, match="closed during the call"):
        for _ in stream:
            pass
    with pytest.raises(kvstored.ClientClosed):
        c.stream(tokens).wait()


def test_a_client_closed_while_its_session_opens_raises_client_closed(daemon) -> None:  # type: ignore[no-untyped-def]
    """Found by tests/integration/test_sdk_random.py. Was: another thread closing the client just
    as a call opened its session cancelled the new session's stream, and the call raised
    DaemonNotRunning ("ended the session at once"), blaming a daemon that was fine."""
    import queue

    c = kvstored.Client(daemon.socket)
    real = c._watch_session

    def watch(call, done, first) -> None:  # type: ignore[no-untyped-def]
        box: queue.Queue[object] = queue.Queue()
        watcher = threading.Thread(target=real, args=(call, done, box), daemon=True)
        watcher.start()
        opened = box.get(timeout=10)   # the session is open ...
        c.close()                      # ... when another thread closes the client
        watcher.join(10)               # (the watcher sees the session end)
        first.put(opened)              # only then does the opening call hear of its session

    c._watch_session = watch  # type: ignore[method-assign]
    with pytest.raises(kvstored.ClientClosed, match="closed during the call"):
        c.load(np.arange(32))


def test_unregistering_buffers_as_the_daemon_dies_is_quiet(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Was: an engine shutting down as the daemon died got DaemonNotRunning from
    unregister_buffers (its teardown failed) although the daemon's mappings of the buffers had
    ended with it. The daemon is frozen so that the call is in flight when it dies."""
    d = daemon_factory("--set", "ssd.enabled=false")
    engine = kvstored.shm.empty((4, 2, 16, 2, 8), "float16")
    c = kvstored.Client(d.socket, timeout_s=10)
    outcome: list[BaseException | None] = []
    try:
        buffers = c.register_buffers([engine.numpy()], 0, namespace=Namespace(model="unreg-gone", kv_dtype="float16"))
        assert c.save_blocks(buffers, [0], np.arange(16)).stored == 1
        d.proc.send_signal(signal.SIGSTOP)

        def unregister() -> None:
            try:
                c.unregister_buffers(buffers)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=unregister)
        t.start()
        time.sleep(1.0)          # the call waits on the frozen daemon
        d.stop(signal.SIGKILL)
        t.join(15)
        assert not t.is_alive()
        assert outcome == [None], outcome
        restart(d)   # a daemon again: the buffers stay unregistered, not registered anew on use
        with pytest.raises(kvstored.NotFound, match="unregistered"):
            c.save_blocks(buffers, [1], np.arange(16, 32))
    finally:
        c.close()
        engine.close()


def test_a_load_dtype_that_bytes_cannot_be_viewed_as_is_invalid_argument(client) -> None:  # type: ignore[no-untyped-def]
    """Was: ZeroDivisionError (a dtype of no size: str, "V0") or numpy's TypeError (object), on a
    hit and on a miss; the docstring promises InvalidArgument and nothing leased."""
    ns = Namespace(model="load-dtype")
    tokens = np.arange(16 * 3)
    client.save(tokens, rows(3, 256), namespace=ns)
    for bad in (str, "V0", object):
        for prompt in (tokens, np.arange(9000, 9016)):   # a hit and a miss
            with pytest.raises(kvstored.InvalidArgument, match="dtype"):
                client.load(prompt, dtype=bad, namespace=ns)
    assert active_leases(client) == 0
    assert client.load(tokens, dtype=np.float32, namespace=ns).data.shape == (3, 64)


def test_a_stream_left_early_then_waited_on_is_closed_not_a_stopping_daemon(client) -> None:  # type: ignore[no-untyped-def]
    """Was: after a ``break`` out of the loop, looping again or ``wait()`` raised
    DaemonNotRunning ("cancelled the call: it is stopping") from the SDK's own cancellation, and
    an engine took the daemon for down."""
    ns = Namespace(model="left-early")
    tokens = np.arange(16 * 4)
    client.save(tokens, rows(4, 256), namespace=ns)
    stream = client.stream(tokens, namespace=ns)
    for _ in stream:
        break
    assert stream.outcome is None
    assert list(stream) == []
    with pytest.raises(kvstored.KVStoreError, match="closed before its end") as info:
        stream.wait()
    assert not isinstance(info.value, kvstored.DaemonNotRunning)
    assert active_leases(client) == 0
    assert client.lookup(tokens, namespace=ns).blocks == 4   # the daemon is fine


def test_one_buffer_not_in_a_list_is_refused_not_registered_as_its_slices(client) -> None:  # type: ignore[no-untyped-def]
    """Was: ``register_buffers(buffer, 1)`` (one buffer of all layers, not wrapped in a list)
    registered the buffer's K and V halves as two tensors, with block_dim 1 of each (the tokens
    of a block): 16 "blocks" of 256 bytes that are no block of the engine's, saved and loaded
    without a word. And block_dim True or 1.0 raised protobuf's TypeError."""
    buf = kvstored.shm.empty((2, 8, 16, 2, 4), "float16")
    ns = Namespace(model="one-buffer")
    for single in (buf.numpy(), buf.torch()):
        with pytest.raises(kvstored.InvalidArgument, match="list of tensors"):
            client.register_buffers(single, block_dim=1, namespace=ns)
    with pytest.raises(kvstored.InvalidArgument, match="list of tensors"):
        client.register_buffers(buf, block_dim=1, namespace=ns)   # type: ignore[arg-type]
    for bad in (True, 1.0, [1.0], "1"):
        with pytest.raises(kvstored.InvalidArgument, match="block_dim"):
            client.register_buffers([buf.numpy()], block_dim=bad, namespace=ns)   # type: ignore[arg-type]
    b = client.register_buffers((t for t in [buf.torch()]), block_dim=np.int64(1), namespace=ns)
    assert (b.num_blocks, b.block_bytes, b.num_tensors) == (8, 2 * 16 * 2 * 4 * 2, 1)


def test_block_ids_that_are_no_sequence_of_ints_are_invalid_argument(client) -> None:  # type: ignore[no-untyped-def]
    """Was: an iterator of ids with a bad one raised OverflowError (the iterator was used up
    before the bad id could be named), None or an int as block_ids TypeError, and stream() took
    an iterator's len()."""
    import torch

    tokens = np.arange(48)
    layers = [kvstored.shm.empty((2, 8, 16, 2, 8), "float16") for _ in range(2)]
    bufs = client.register_buffers([t.numpy() for t in layers], 1, namespace=Namespace(model="id-kinds"))
    with pytest.raises(kvstored.InvalidArgument, match=r"block_ids\[2\] = -3"):
        client.save_blocks(bufs, (i for i in [0, 1, -3]), tokens)
    for bad in (None, 3, np.array([[0, 1, 2]]), torch.tensor([0.0, 1.0, 2.0])):
        with pytest.raises(kvstored.InvalidArgument, match="block_ids"):
            client.save_blocks(bufs, bad, tokens)   # type: ignore[arg-type]
        with pytest.raises(kvstored.InvalidArgument, match="block_ids"):
            client.load_blocks(bufs, bad, tokens)   # type: ignore[arg-type]
    assert client.save_blocks(bufs, (i for i in [0, 1, 2]), tokens).stored == 3
    assert client.load_blocks(bufs, iter([3, 4, 5]), tokens).blocks == 3
    assert client.load_blocks(bufs, torch.tensor([3, 4, 5]), tokens).blocks == 3
    stream = client.stream(tokens, buffers=bufs, block_ids=(i for i in [5, 6, 7]))
    assert [a.index for a in stream] == [0, 1, 2] and stream.outcome is not None and stream.outcome.complete
    assert (layers[0].numpy()[:, 5:8] == layers[0].numpy()[:, 0:3]).all()


def test_a_stream_into_buffers_refuses_a_namespace_that_is_not_theirs(client) -> None:  # type: ignore[no-untyped-def]
    """Was: ``stream(..., buffers=b, namespace=ns)`` hashed and streamed in the buffers' namespace
    whatever ``ns`` said (another block size, another model) without a word."""
    ns = Namespace(model="stream-ns", block_size=16)
    layers = [kvstored.shm.empty((2, 8, 16, 2, 8), "float16") for _ in range(2)]
    bufs = client.register_buffers([t.numpy() for t in layers], 1, namespace=ns)
    tokens = np.arange(48)
    client.save_blocks(bufs, [0, 1, 2], tokens)
    for other in (Namespace(model="stream-ns", block_size=8), Namespace(model="elsewhere")):
        with pytest.raises(kvstored.InvalidArgument, match="not the buffers' namespace"):
            client.stream(tokens, buffers=bufs, block_ids=[3, 4, 5], namespace=other)
    for same in (ns, bufs.namespace):   # the engine's own namespace, with or without the layout
        outcome = client.stream(tokens, buffers=bufs, block_ids=[3, 4, 5], namespace=same).wait()
        assert outcome.complete and outcome.blocks == 3


@pytest.mark.parametrize("path", ["commit", "reserve"])
def test_close_from_another_thread_waits_for_rows_being_copied_into_the_arena(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """(found by test_sdk_random, saves without waiting and clients closed by other threads) A
    save copies its rows into slots of its session (spare slots, or a reservation's) before it
    names them; a close from another thread ended the session meanwhile, the daemon gave those
    slots to other blocks, and the copy still landed there: another prompt's block read back
    with wrong bytes. close() now waits for the copy, and a save that starts copying after the
    close raises ClientClosed."""
    import kvstored_client.client as sdk
    c = kvstored.Client(daemon.socket, **({} if path == "commit" else {"fast_path": False}))
    if path == "reserve":
        monkeypatch.setattr(sdk.Client, "_save_by_commit", lambda self, *a, **k: None)
    c.save(np.arange(16), rows(1))   # the block size (and spares)
    copying, release = threading.Event(), threading.Event()
    real = sdk.copy_rows

    def slow_copy(arena, offsets, data, to_arena):  # type: ignore[no-untyped-def]
        if to_arena:
            copying.set()
            release.wait(10)
        real(arena, offsets, data, to_arena=to_arena)
    monkeypatch.setattr(sdk, "copy_rows", slow_copy)
    saver = ThreadPoolExecutor(1).submit(c.save, np.arange(16, 64), rows(3, seed=1))
    assert copying.wait(10)
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close ended the session while rows were being copied into its slots"
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    try:
        saver.result(10)   # stored, or the closed client said so: never a write after the end
    except kvstored.KVStoreError:
        pass
    with pytest.raises(kvstored.ClientClosed):
        c.save(np.arange(64, 80), rows(1))
