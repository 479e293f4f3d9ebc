"""Lookups answered by the SDK from the daemon's presence table, against real daemons: where the
table is and who may read it, the same answers as the daemon's own lookup after every kind of
change (saves, evictions, SSD copies, promotions, flush, a model's eviction, a restart), the hits
reaching the daemon's policy and promotions, a daemon gone or restarted, an overflowing table.
(The SDK's contract tests run over it too: the shared ``client`` fixture's "frames" variant
answers its plain lookups from the table.)"""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import kvstored
from conftest import Daemon, start_daemon
from kvstored_client.contract import hashing
from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.presence import presence_table_path

Factory = Callable[..., Daemon]
BLOCK = 16


def prompt(i: int, blocks: int) -> np.ndarray:
    """A prompt of ``blocks`` whole blocks, its own from its first token on."""
    return np.arange(blocks * BLOCK) + i * 1_000_000


def until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


@pytest.fixture
def pair(daemon: Daemon) -> Iterator[tuple[kvstored.Client, kvstored.Client]]:
    """Two clients of ``daemon``: one answering lookups from the table, one asking the daemon."""
    with kvstored.Client(daemon.socket) as table, kvstored.Client(daemon.socket, fast_path=False) as rpc:
        assert table.lookup_transport == "table" and rpc.lookup_transport == "grpc"
        yield table, rpc


def same(table: kvstored.Client, rpc: kvstored.Client, prompts: list[np.ndarray], tiers: bool = True) -> None:
    """Each prompt's lookup the same from the table as from the daemon (``tiers``: on the same
    tiers; not where a lookup's promotion may have moved blocks up meanwhile)."""
    for p in prompts:
        # hashes as well as tokens: the table takes the chain as the call would
        by_hash = kvstored.block_hashes(p.tolist())
        answers = [table.lookup(p), rpc.lookup(p), table.lookup(hashes=by_hash)]
        if tiers:
            assert answers[0] == answers[1] == answers[2]
        else:
            assert len({(a.tokens, a.blocks, sum(a.per_tier.values())) for a in answers}) == 1
    assert table.lookup_transport == "table"


def test_the_table_sits_next_to_the_socket_with_its_mode_and_goes_with_the_daemon(daemon_factory: Factory) -> None:
    d = daemon_factory("--set", "server.socket_mode=0640")
    path = Path(presence_table_path(d.socket))
    assert path.parent == Path(d.socket).parent and stat.S_ISREG(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(d.socket).st_mode) == 0o640
    with kvstored.Client(d.socket) as c:
        assert c.lookup_transport == "table"
    d.stop()
    assert not path.exists()


def test_no_table_without_the_fast_path(daemon_factory: Factory) -> None:
    off = daemon_factory("--set", "server.presence_table=false")
    assert not Path(presence_table_path(off.socket)).exists()
    with kvstored.Client(off.socket) as c:
        assert c.lookup_transport == "frames"
        c.save(prompt(1, 2), np.ones((2, 64), np.uint8))
        assert c.lookup(prompt(1, 2)).blocks == 2
    with kvstored.Client(off.socket, fast_path=False) as c:
        assert c.lookup_transport == "grpc"


def test_table_lookups_equal_the_daemons_after_every_kind_of_change(
        daemon: Daemon, pair: tuple[kvstored.Client, kvstored.Client]) -> None:
    table, rpc = pair
    prompts = [prompt(i, n) for i, n in enumerate((1, 3, 8, 40))]
    longer = [np.concatenate([p, prompt(100 + i, 2)]) for i, p in enumerate(prompts)]
    same(table, rpc, prompts + longer)                          # nothing cached
    for p in prompts:
        table.save(p, np.full((len(p) // BLOCK, 256), 7, np.uint8))
    same(table, rpc, prompts + longer)                          # in DRAM
    table.flush()
    same(table, rpc, prompts + longer)                          # in DRAM, with SSD copies
    table.evict(tier="dram")
    assert table.lookup(prompts[3]).per_tier == {"ssd": 40}
    same(table, rpc, prompts[:3] + longer[:3], tiers=False)     # on SSD only (prompts[3]: below)
    # a lookup from the table of SSD-only blocks starts their promotion, as the daemon's does
    until(lambda: table.lookup(prompts[3]).per_tier == {"dram": 40}, "promotion after a table lookup")
    same(table, rpc, prompts + longer)
    table.evict(tier="ssd")
    same(table, rpc, prompts + longer)
    table.evict()
    same(table, rpc, prompts + longer)                          # gone
    # a chain part in DRAM, part on SSD only
    table.save(prompts[2], np.ones((8, 256), np.uint8))
    table.flush()
    table.evict(tier="dram")
    table.save(longer[2], np.ones((10, 256), np.uint8))
    assert table.lookup(longer[2]).per_tier == {"dram": 2, "ssd": 8}
    until(lambda: rpc.lookup(longer[2]).per_tier == {"dram": 10}, "promotion after a table lookup")
    same(table, rpc, prompts + longer)


def test_a_table_lookup_is_a_use_of_the_prefix_for_eviction(daemon_factory: Factory) -> None:
    # 16 slots of 256 KiB, each a block's (no spare slots), no SSD tier, LRU:
    # the block a lookup touched last is not the one to go
    d = daemon_factory("--dram-capacity", "4MiB", "--set", "ssd.enabled=false", "--set", "dram.policy=lru",
                       "--set", "dram.spare_bytes=0")
    ns = Namespace(model="lru")
    with kvstored.Client(d.socket, namespace=ns) as c:
        row = np.ones((1, 256 << 10), np.uint8)
        for i in range(16):
            assert c.save(prompt(i, 1), row).stored == 1
        lookups = c.stats()["lookups"]
        assert c.lookup(prompt(0, 1)).blocks == 1 and c.lookup_transport == "table"
        # sent one-way on the connection the next call takes: the daemon has it before that call
        assert c.stats()["lookups"] == lookups + 1
        assert c.save(prompt(16, 1), row).stored == 1           # one block has to go
        assert c.lookup(prompt(0, 1)).blocks == 1
        assert c.lookup(prompt(1, 1)).blocks == 0


def saved_on(socket: str, tokens: np.ndarray) -> bool:
    try:
        with kvstored.Client(socket) as c:
            return c.save(tokens, np.ones((len(tokens) // BLOCK, 64), np.uint8)).stored > 0
    except kvstored.DaemonNotRunning:
        return False


def test_a_daemon_killed_gives_the_same_error_and_a_restarted_one_answers(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "d", "--set", "ssd.enabled=false")
    p = prompt(1, 4)
    table = kvstored.Client(d.socket, timeout_s=5.0)
    rpc = kvstored.Client(d.socket, timeout_s=5.0, fast_path=False)
    try:
        table.save(p, np.ones((4, 64), np.uint8))
        assert table.lookup(p).blocks == 4 and table.lookup_transport == "table"
        d.stop(signal.SIGKILL)
        errors = []
        for c in (table, rpc):
            with pytest.raises(kvstored.KVStoreError) as err:
                c.lookup(p)
            errors.append((type(err.value), err.value.reason))
        assert errors[0] == errors[1] and errors[0][0] is kvstored.DaemonNotRunning
        # a new daemon on the same socket, holding other blocks
        e = start_daemon(tmp_path / "d", "--set", "ssd.enabled=false")
        try:
            # (gRPC shares the dead daemon's connection, backing off, among this process's
            # channels to the socket: a new client may find it failing for a moment too)
            until(lambda: saved_on(e.socket, prompt(2, 3)), "a new client saving on the new daemon")
            until(lambda: rpc.lookup(prompt(2, 3)).blocks == 3, "the gRPC client reconnecting")
            until(lambda: table.lookup(prompt(2, 3)).blocks == 3 and table.lookup_transport == "table",
                  "the table client on the new daemon's table")
            assert table.lookup(p).blocks == 0 == rpc.lookup(p).blocks
        finally:
            e.stop()
    finally:
        table.close()
        rpc.close()


def test_blocks_restored_from_ssd_at_a_restart_are_in_the_new_table(tmp_path: Path) -> None:
    prompts = [prompt(i, n) for i, n in enumerate((2, 5))]
    d = start_daemon(tmp_path / "d")
    with kvstored.Client(d.socket) as c:
        for p in prompts:
            c.save(p, np.ones((len(p) // BLOCK, 64), np.uint8))
    assert d.stop() == 0   # a clean stop writes DRAM-only blocks to SSD
    e = start_daemon(tmp_path / "d")   # the same socket and SSD directory
    try:
        with kvstored.Client(e.socket) as table, kvstored.Client(e.socket, fast_path=False) as rpc:
            assert table.lookup(prompts[1]).per_tier == {"ssd": 5}   # first: nothing promoted yet
            same(table, rpc, prompts, tiers=False)
            until(lambda: table.lookup(prompts[1]).per_tier == {"dram": 5}, "promotion after a table lookup")
    finally:
        e.stop()


def test_an_overflowing_table_still_answers_as_the_daemon(daemon_factory: Factory) -> None:
    d = daemon_factory("--set", "server.presence_buckets=1")    # one bucket: 8 blocks fit
    with kvstored.Client(d.socket) as table, kvstored.Client(d.socket, fast_path=False) as rpc:
        prompts = [prompt(i, 3) for i in range(6)]
        for p in prompts[:5]:
            table.save(p, np.ones((3, 64), np.uint8))
        same(table, rpc, prompts)
        table.evict(tier="dram")
        same(table, rpc, prompts)


def test_a_save_of_blocks_all_cached_is_answered_from_the_table(pair: tuple[kvstored.Client, kvstored.Client]) -> None:
    table, rpc = pair
    p, longer = prompt(1, 4), prompt(1, 6)
    kv = np.ones((6, 256), np.uint8)
    assert table.save(p, kv[:4]).stored == 4 and table.table_saves == 0
    again = table.save(p, kv[:4])
    assert table.table_saves == 1 and again == rpc.save(p, kv[:4])
    assert (again.present, again.stored) == (4, 0)
    assert table.save(p, kv[:2], start=2) == rpc.save(p, kv[:2], start=2) and table.table_saves == 2
    grown = table.save(longer, kv)                               # two new blocks: the call
    assert (grown.present, grown.stored) == (4, 2) and table.table_saves == 2
    with pytest.raises(kvstored.InvalidArgument):                # mistakes are still the daemon's to say
        table.save(p, np.ones((4, 128), np.uint8))
    table.evict()
    assert table.save(p, kv[:4]).stored == 4 and table.table_saves == 2
    with pytest.raises(kvstored.FailedPrecondition):             # a push always takes the call (no peers here)
        table.save(p, kv[:4], push_to="nowhere")
    assert table.table_saves == 2


def test_a_table_lookup_of_tokens_hashes_only_as_far_as_the_cached_prefix_goes(
        pair: tuple[kvstored.Client, kvstored.Client], monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain's hashes come one block after the other (~1 us each in Python: 2 ms for a 32k
    prompt), and a lookup only needs them up to the first block not cached: the SDK hashes 32
    blocks, then four times as many while the table holds them all. The answers are the daemon's
    at every length around those steps, the daemon counts the whole prompt as asked for, and a
    bad token past the prefix is still refused."""
    table, rpc = pair
    hashed: list[int] = []
    real = hashing.ChainHasher.hashes

    def counting(self, token_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(self, token_ids, *args, **kwargs)
        hashed.append(len(out))
        return out
    monkeypatch.setattr(hashing.ChainHasher, "hashes", counting)
    long = 600
    for i, cached in enumerate((0, 1, 31, 32, 33, 127, 128, 129, 513, long)):
        p = prompt(100 + i, long)
        if cached:
            rpc.save(p[: cached * BLOCK], np.full((cached, 64), i, np.uint8))
        hashed.clear()
        asked = rpc.stats()["lookup_blocks"]
        got = table.lookup(p)
        most = max(hashed)
        assert got.blocks == cached == rpc.lookup(p).blocks, (cached, got)
        # 32, 128, 512, then all: the last step reaches past the cached prefix, or the prompt's end
        assert most == next(s for s in (32, 128, 512, long) if s > cached or s == long), (cached, hashed)
        until(lambda asked=asked: rpc.stats()["lookup_blocks"] >= asked + 2 * long,
              "the table lookup counted whole")
    with pytest.raises(kvstored.InvalidArgument):
        table.lookup(np.concatenate([prompt(200, 40), [-1]]))
