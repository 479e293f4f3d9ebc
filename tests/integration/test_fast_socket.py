"""The fast socket (the hot calls in frames on the daemon's second socket) against a real daemon:
where its socket is and who may open it, the SDK's fallback to gRPC, typed errors with their
reasons, deadlines, and hostile frames. The SDK's contract tests run over it too (the shared
``client`` fixture runs each of them over both transports)."""

from __future__ import annotations

import os
import random
import signal
import stat
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from loopback import free_ports
from prometheus_client.parser import text_string_to_metric_families

import kvstored
from conftest import ROOT, Daemon
from kvstored_client.contract.errors import Reason
from kvstored_client.contract.frames import fast_socket_path
from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.proto import kvstored_pb2 as pb
from tools import fuzz

Factory = Callable[..., Daemon]


def bad_requests(port: int) -> dict[tuple[tuple[str, str], ...], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kvstored_bad_requests_total"}


def test_the_fast_socket_sits_next_to_the_socket_with_its_mode(daemon_factory: Factory) -> None:
    d = daemon_factory("--set", "server.socket_mode=0640")
    fast = fast_socket_path(d.socket)
    assert Path(fast).parent == Path(d.socket).parent
    assert stat.S_ISSOCK(os.stat(fast).st_mode)
    assert stat.S_IMODE(os.stat(fast).st_mode) == stat.S_IMODE(os.stat(d.socket).st_mode) == 0o640
    with kvstored.Client(d.socket) as c:
        assert c.transport == "frames"
        tokens = np.arange(64)
        assert c.save(tokens, np.ones((4, 512), np.uint8)).stored == 4
        assert c.lookup(tokens).blocks == 4
    d.stop()
    assert not Path(fast).exists() and not Path(d.socket).exists()   # both removed at the stop


def test_the_fast_path_off_in_the_config_keeps_every_call_on_grpc(daemon_factory: Factory) -> None:
    d = daemon_factory("--set", "server.fast_socket=false")
    assert not Path(fast_socket_path(d.socket)).exists()
    with kvstored.Client(d.socket) as c:
        assert c.transport == "grpc"
        tokens = np.arange(64)
        c.save(tokens, np.ones((4, 512), np.uint8))
        assert c.load(tokens).blocks == 4 and c.stats()["saved_blocks"] == 4


def test_a_fast_socket_that_cannot_be_opened_leaves_the_calls_on_grpc(
        daemon_factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon_factory()
    tokens = np.arange(64)
    with kvstored.Client(d.socket) as before:
        assert before.transport == "frames"
        os.unlink(fast_socket_path(d.socket))   # (the open connection is not affected)
        with kvstored.Client(d.socket) as after:
            assert after.transport == "grpc"
            after.save(tokens, np.ones((4, 512), np.uint8))
            assert after.lookup(tokens).blocks == 4
        assert before.lookup(tokens).blocks == 4 and before.transport == "frames"
    # forced to gRPC by the environment, with the socket there
    monkeypatch.setenv("KVSTORED_FAST_PATH", "0")
    e = daemon_factory()
    with kvstored.Client(e.socket) as forced:
        assert forced.transport == "grpc" and forced.lookup(tokens).blocks == 0


def test_errors_over_frames_carry_their_class_and_reason_and_are_counted(daemon_factory: Factory) -> None:
    (port,) = free_ports(1)
    d = daemon_factory("--set", "server.max_batch_blocks=4", "--set", f"server.metrics=127.0.0.1:{port}")
    with kvstored.Client(d.socket) as c:
        assert c.transport == "frames"
        with pytest.raises(kvstored.InvalidArgument) as too_many:
            c.lookup(np.arange(16 * 5))
        assert too_many.value.reason == Reason.TOO_MANY_BLOCKS
        assert bad_requests(port)[(("kind", "too_many_blocks"), ("method", "Lookup"))] == 1
        # a lease released twice (the SDK never does it: through its plumbing, as a raw client
        # would): the second names a lease the session no longer holds
        tokens = np.arange(64)
        c.save(tokens, np.ones((4, 512), np.uint8))
        session = c._session()
        lease = c._call(c._stub.Lookup, pb.LookupRequest(
            namespace_id=c._ns(None)[0], session_id=session, lease=True,
            keys=pb.BlockKeys(token_ids=tokens.tolist()))).lease_id
        c._call(c._stub.Release, pb.ReleaseRequest(session_id=session, lease_id=lease))
        with pytest.raises(kvstored.NotFound) as twice:
            c._call(c._stub.Release, pb.ReleaseRequest(session_id=session, lease_id=lease))
        assert twice.value.reason == Reason.UNKNOWN_LEASE
        assert c.transport == "frames" and c.load(tokens).blocks == 4   # the connection still serves


def test_a_frozen_daemon_gives_a_deadline_error_over_frames_then_serves_again(daemon_factory: Factory) -> None:
    d = daemon_factory()
    c = kvstored.Client(d.socket, timeout_s=1.0, namespace=Namespace(model="frozen", block_bytes=512))
    tokens = np.arange(64)
    c.save(tokens, np.ones((4, 512), np.uint8))
    assert c.load(tokens).blocks == 4 and c.table_loads == 1   # from the table: no lease
    assert c.transport == "frames"
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        # (a plain lookup and a load of blocks in DRAM are answered from the daemon's presence
        # table, frozen as the daemon is)
        assert c.lookup(tokens).blocks == 4 and c.lookup_transport == "table"
        assert c.load(tokens).blocks == 4 and c.table_loads == 2
        with pytest.raises(kvstored.DeadlineExceeded, match="within 1 s"):
            c.save(np.arange(64, 128), np.ones((4, 512), np.uint8))
        with pytest.raises(kvstored.DeadlineExceeded):
            c.stats()
        assert time.monotonic() - t0 < 20
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    # a fresh connection: a late answer to the calls above is never taken for the next one's
    assert c.lookup(tokens).blocks == 4
    # The save past its deadline: its Commit (one call) is served once the daemon runs again, as
    # any call past its deadline may be; what it stored is whole and right.
    time.sleep(0.5)   # (served on the connection the SDK gave up on, unordered with the calls here)
    late = c.load(np.arange(64, 128))
    assert c.stats()["saved_blocks"] == 4 + late.blocks and late.blocks in (0, 4)
    assert (late.data == 1).all()
    assert c.transport == "frames"
    c.close()


def test_hostile_frames_leave_a_daemon_that_serves_and_a_quiet_log(tmp_path: Path, daemon_factory: Factory) -> None:
    seed = int(os.environ.get("KVSTORED_FUZZ_SEED", time.time_ns() % (1 << 32)))
    print(f"fuzz seed {seed} (KVSTORED_FUZZ_SEED={seed} repeats this run)")
    shm = tmp_path / "shm"
    shm.mkdir()
    d = daemon_factory("--set", "log.level=info", "--set", f"dram.shm_dir={shm}")
    documented = fuzz.documented_statuses((ROOT / "README.md").read_text())
    report = fuzz.run(d.socket, 300, seed, 10.0, documented, fuzz.stats_check(d.socket), every=100,
                      transport="frames")
    assert report.ok, report.text()
    assert report.by_method[fuzz.FRAME]["CLOSED"] > 0, report.text()
    rng = random.Random(seed)
    for kind in fuzz.FRAME_KINDS:   # each kind at least once, whatever the draw
        outcome = fuzz.fire_bad_frame(fast_socket_path(d.socket), fuzz.bad_frame(rng, kind), kind, 10.0)
        assert outcome.status in fuzz.FRAME_OUTCOMES, outcome
    with kvstored.Client(d.socket) as c:
        assert c.transport == "frames" and c.stats()["version"]
    log = d.log()
    assert "Traceback" not in log and len(log) < 64 << 10, log[-3000:]


def test_a_forked_child_calls_on_connections_of_its_own(daemon_factory: Factory) -> None:
    """A child forked from a process with a client must not read its parent's answers (nor the
    parent the child's) on the connection both would otherwise share."""
    d = daemon_factory()
    with kvstored.Client(d.socket, timeout_s=5.0) as c:
        mine, other = np.arange(16), np.arange(16) + 1000
        c.save(mine, np.ones((1, 64), np.uint8))
        assert c.lookup(mine).blocks == 1 and c.transport == "frames"
        pid = os.fork()
        if pid == 0:   # the child: asks of a prefix nobody saved; never returns into pytest
            code = 1
            try:
                code = 0 if all(c.lookup(other).blocks == 0 for _ in range(200)) else 1
            finally:
                os._exit(code)
        try:
            parent_ok = all(c.lookup(mine).blocks == 1 for _ in range(200))
        finally:
            _, status = os.waitpid(pid, 0)
        assert parent_ok and os.waitstatus_to_exitcode(status) == 0


def test_a_loads_lease_is_released_before_the_calls_that_would_see_it(daemon_factory: Factory,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A load over frames gives its lease back without waiting for an answer; every later call
    that acts on leases must still find it given back: the same thread's next call, an evict
    over gRPC right after, and stats after loads on other threads. (Without the presence table,
    which would answer these loads without a lease.)"""
    import threading

    monkeypatch.setenv("KVSTORED_PRESENCE_TABLE", "0")
    d = daemon_factory()
    with kvstored.Client(d.socket) as c:
        assert c.transport == "frames"
        tokens, rows = np.arange(64), np.arange(4 * 512, dtype=np.uint32).view(np.uint8).reshape(4, -1)
        for _ in range(20):
            assert c.save(tokens, rows).stored == 4
            assert np.array_equal(c.load(tokens).data, rows)
            assert c.evict() == 4   # (over gRPC) a block still leased would have stayed
            assert c.lookup(tokens).blocks == 0
        c.save(tokens, rows)

        def loads() -> None:
            for _ in range(10):
                assert c.load(tokens).blocks == 4

        threads = [threading.Thread(target=loads) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert c.stats()["active_leases"] == 0
        assert c.evict() == 4
