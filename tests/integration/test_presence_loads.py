"""Loads without a lease, against real daemons: blocks the presence table shows in DRAM are
copied straight from the arena and checked against the table's where words, and the load is
told to the daemon one-way. The same rows, ``start``, ``out`` and ``dtype`` as a leased load;
the leased path wherever the table cannot vouch (switched off, blocks on SSD); the hits reach
the daemon's policy; and loads racing evictions and re-saves of the same slots by another
process never return another block's bytes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvstored
from conftest import ROOT, Daemon
from kvstored_client.presence import ORDERED_LOADS

Factory = Callable[..., Daemon]
BLOCK = 16
WIDTH = 4096   # bytes a block

pytestmark = pytest.mark.skipif(not ORDERED_LOADS, reason="loads take the lease on this CPU (no x86-64 load order)")


def prompt(i: int, blocks: int) -> np.ndarray:
    """A prompt of ``blocks`` whole blocks, its own from its first token on."""
    return np.arange(blocks * BLOCK) + i * 1_000_000


def rows(i: int, blocks: int, width: int = WIDTH) -> np.ndarray:
    """Prompt ``i``'s KV: every block's bytes its own (the same whoever saves it)."""
    return np.random.default_rng(i).integers(0, 256, (blocks, width), np.uint8)


@pytest.fixture
def pair(daemon: Daemon) -> Iterator[tuple[kvstored.Client, kvstored.Client]]:
    """Two clients of ``daemon``: one loading from the table, one always through a lease."""
    with kvstored.Client(daemon.socket) as table, kvstored.Client(daemon.socket, fast_path=False) as leased:
        assert table.lookup_transport == "table"
        yield table, leased


def test_a_load_of_blocks_in_dram_takes_no_call_and_gives_what_a_leased_load_gives(
        pair: tuple[kvstored.Client, kvstored.Client]) -> None:
    table, leased = pair
    for i, n in enumerate((1, 3, 4, 5, 40)):    # one block at a time up to 4, numpy past that
        p = prompt(i, n)
        want = rows(i, n)
        table.save(p, want)
        longer = np.concatenate([p, prompt(100 + i, 2)])   # only its first n blocks are cached
        for tokens in (p, longer):
            before = table.table_loads
            got = table.load(tokens)
            assert table.table_loads == before + 1
            assert got.blocks == n and got.tokens == n * BLOCK and np.array_equal(got.data, want)
            other = leased.load(tokens)
            assert (other.tokens, other.blocks) == (got.tokens, got.blocks) and np.array_equal(other.data, got.data)
        for start in (0, 1, n - 1, n, n + 3):
            got = table.load(p, start=start)
            assert got.blocks == n and np.array_equal(got.data, want[start:])
            assert np.array_equal(leased.load(p, start=start).data, got.data)
        out = np.zeros((n + 2, WIDTH), np.uint8)
        got = table.load(p, out=out)
        assert np.shares_memory(got.data, out) and np.array_equal(out[:n], want) and not out[n:].any()
        got = table.load(hashes=kvstored.block_hashes(p.tolist()), dtype=np.float16)
        assert got.data.dtype == np.float16 and np.array_equal(got.data.view(np.uint8), want)   # (NaNs among them)
    assert table.load(prompt(99, 3)).blocks == 0
    assert leased.table_loads == 0
    # mistakes are answered as before, whichever path: nothing was read
    with pytest.raises(kvstored.InvalidArgument):
        table.load(prompt(4, 40), out=np.zeros((2, WIDTH), np.uint8))
    with pytest.raises(kvstored.InvalidArgument):
        table.load(prompt(4, 40), dtype=np.dtype([("a", np.uint8, 3)]))


def test_a_reader_that_came_before_any_save_reads_the_table_once_a_load_has_seen_the_block_size(
        daemon: Daemon) -> None:
    """An engine that looks up before anything is saved (a cold node) opens the namespace while its
    block size is unknown; the first load whose reply shows the size lets the next ones skip the
    lease, without asking the daemon again."""
    with kvstored.Client(daemon.socket) as reader, kvstored.Client(daemon.socket) as writer:
        p = prompt(7, 3)
        assert reader.load(p).blocks == 0 and reader.lookup(p).blocks == 0
        writer.save(p, rows(7, 3))
        first = reader.load(p)   # leased: the namespace's size was 0 when it was opened
        assert first.blocks == 3 and np.array_equal(first.data, rows(7, 3))
        before = reader.table_loads
        for _ in range(3):
            again = reader.load(p)
            assert again.blocks == 3 and np.array_equal(again.data, rows(7, 3))
        assert reader.table_loads == before + 3


def test_blocks_the_table_cannot_vouch_for_take_the_lease(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    p, want = prompt(1, 6), rows(1, 6)
    with kvstored.Client(daemon.socket) as c:
        c.save(p, want)
        c.flush()
        c.evict(tier="dram")                     # on SSD only: the lease brings them up
        got = c.load(p)
        assert c.table_loads == 0 and got.blocks == 6 and np.array_equal(got.data, want)
        got = c.load(p)                          # in DRAM now
        assert c.table_loads == 1 and np.array_equal(got.data, want)
    monkeypatch.setenv("KVSTORED_PRESENCE_TABLE", "0")
    with kvstored.Client(daemon.socket) as off, kvstored.Client(daemon.socket, fast_path=False) as grpc:
        for c in (off, grpc):
            got = c.load(p)
            assert c.table_loads == 0 and np.array_equal(got.data, want)


def test_a_load_from_the_table_is_a_use_of_the_prefix_for_eviction(daemon_factory: Factory) -> None:
    # 16 slots of 256 KiB, each a block's (no spare slots), no SSD tier, LRU:
    # the block loaded last is not the one to go
    d = daemon_factory("--dram-capacity", "4MiB", "--set", "ssd.enabled=false", "--set", "dram.policy=lru",
                       "--set", "dram.spare_bytes=0")
    with kvstored.Client(d.socket) as c:
        for i in range(16):
            assert c.save(prompt(i, 1), rows(i, 1, 256 << 10)).stored == 1
        lookups = c.stats()["lookups"]
        got = c.load(prompt(0, 1))
        assert c.table_loads == 1 and np.array_equal(got.data, rows(0, 1, 256 << 10))
        assert c.stats()["lookups"] == lookups + 1   # told one-way, before the next call
        assert c.save(prompt(16, 1), rows(16, 1, 256 << 10)).stored == 1   # one block has to go
        assert c.lookup(prompt(0, 1)).blocks == 1
        assert c.lookup(prompt(1, 1)).blocks == 0


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    import kvstored
    socket, rounds, blocks, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    def rows(i, n):
        return np.random.default_rng(i).integers(0, 256, (n, width), np.uint8)
    with kvstored.Client(socket) as c:
        for r in range(rounds):
            # others' prompts, evicting the loader's, then the loader's again (maybe into the
            # slots others held a moment ago)
            for i in range(100 + (r % 7) * 8, 108 + (r % 7) * 8):
                c.save(np.arange(blocks * 16) + i * 1_000_000, rows(i, blocks))
            for i in range(4):
                c.save(np.arange(blocks * 16) + i * 1_000_000, rows(i, blocks))
    print("done", flush=True)
""")


def test_loads_racing_evictions_and_re_saves_of_their_slots_never_return_other_bytes(
        daemon_factory: Factory) -> None:
    # 32 slots of 64 KiB without an SSD tier: another process's saves keep evicting the
    # loader's prompts and saving them again, into whatever slots are free
    blocks, width = 4, 64 << 10
    d = daemon_factory("--dram-capacity", "2MiB", "--set", "dram.page_bytes=256KiB", "--set", "ssd.enabled=false",
                       "--set", "dram.policy=lru")
    wants = [rows(i, blocks, width) for i in range(4)]
    with kvstored.Client(d.socket) as c:
        for i, want in enumerate(wants):
            c.save(prompt(i, blocks), want)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, d.socket, "60", str(blocks), str(width)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            loads = hits = 0
            out = np.empty((blocks, width), np.uint8)
            while writer.poll() is None and loads < 20_000:
                i = loads % 4
                got = c.load(prompt(i, blocks), out=out)
                # whatever prefix is cached is the prompt's own bytes, block for block
                for b in range(got.blocks):
                    if not np.array_equal(out[b], wants[i][b]):
                        pytest.fail(f"load {loads} of prompt {i} gave other bytes for block {b} "
                                    f"({c.table_loads} from the table so far)")
                loads += 1
                hits += got.blocks > 0
        finally:
            output = writer.communicate(timeout=120)[0]
        assert writer.returncode == 0 and "done" in output, output
        assert c.table_loads > 0 and hits > 0
