"""The presence table's layout and the SDK's reader of it: fingerprints the same on both sides
for any key bytes, lookups from a table the daemon's writer filled, overflow, another daemon's
table refused."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstored.presence import SMALL_BATCH, PresenceTable
from kvstored_client.contract import presence as layout
from kvstored_client.presence import PresenceReader, TableUnusable


@settings(max_examples=200, deadline=None)
@given(st.integers(0, (1 << 63) - 1), st.sampled_from([16, 32, 13]), st.lists(st.binary(min_size=32, max_size=32),
                                                                           min_size=1, max_size=20))
def test_fingerprints_are_the_same_vectorised_and_one_at_a_time(namespace_id: int, size: int,
                                                                 keys: list[bytes]) -> None:
    keys = [k[:size] for k in keys]
    many = layout.fingerprints(namespace_id, b"".join(keys), size)
    assert many.tolist() == [layout.fingerprint(namespace_id, k) for k in keys]
    assert all(fp & layout.STATE_MASK == 0 and fp & 4 for fp in many.tolist())   # never a free slot


def test_fingerprints_mix_every_byte_and_the_namespace() -> None:
    # keys alike but for one byte anywhere (user hashes need not be uniform): all apart, and the
    # buckets they fall in spread
    base = bytes(32)
    keys = [base[:i] + bytes([1]) + base[i + 1:] for i in range(32)]
    fps = layout.fingerprints(7, b"".join(keys), 32).tolist()
    assert len(set(fps)) == 32
    assert len({layout.bucket_of(fp, 1024) for fp in fps}) > 24
    assert layout.fingerprint(7, base) != layout.fingerprint(8, base)


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A stand-in for the daemon's fast socket."""
    path = str(tmp_path / "fast.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    yield path, server
    server.close()


def keys(n: int, salt: int = 0) -> list[bytes]:
    rng = np.random.default_rng(salt)
    return [rng.bytes(32) for _ in range(n)]


@pytest.mark.parametrize("n", [2, 3, 40, 2048])
def test_a_reader_finds_the_prefix_the_writer_recorded(tmp_path: Path, listener: tuple[str, socket.socket],
                                                       n: int) -> None:
    table = PresenceTable(tmp_path / "t.presence", 1024, 0o600)
    chain = keys(n)
    cut = n * 3 // 4
    for i, key in enumerate(chain[:cut]):
        table.set(5, key, layout.SSD if i >= cut // 2 else layout.DRAM)
    reader = PresenceReader(str(table.path), table.instance_id, listener[0], 5.0)
    packed = b"".join(chain)
    assert reader.lookup(5, packed, 32) == (cut, cut - cut // 2)
    assert reader.lookup(6, packed, 32) == (0, 0)            # another namespace's
    table.set(5, chain[0], layout.PROMOTING)                 # in its slot: counts as DRAM
    assert reader.lookup(5, packed, 32) == (cut, cut - max(cut // 2, 1))
    table.set(5, chain[0], 0)
    assert reader.lookup(5, packed, 32) == (0, 0)
    reader.close()
    table.close()
    assert not table.path.exists()


def test_a_miss_in_an_overflowed_bucket_is_no_answer(tmp_path: Path, listener: tuple[str, socket.socket]) -> None:
    table = PresenceTable(tmp_path / "t.presence", 1, 0o600)   # one bucket: 8 blocks fit
    chain = keys(10)
    for key in chain:
        table.set(1, key, layout.DRAM)
    assert table.overflowed == 1
    reader = PresenceReader(str(table.path), table.instance_id, listener[0], 5.0)
    assert reader.lookup(1, b"".join(chain[:8]), 32) == (8, 0)    # hits are still answers
    assert reader.lookup(1, b"".join(chain), 32) is None          # the ninth is not known
    assert reader.lookup(1, b"".join(keys(6, salt=9)), 32) is None   # nor a new chain's first
    assert table.verify((1, k, layout.DRAM, -1) for k in chain) == []
    table.close()


def test_a_table_of_another_daemon_or_none_is_refused(tmp_path: Path, listener: tuple[str, socket.socket]) -> None:
    table = PresenceTable(tmp_path / "t.presence", 64, 0o640)
    assert os.stat(table.path).st_mode & 0o777 == 0o640
    with pytest.raises(TableUnusable):
        PresenceReader(str(table.path), table.instance_id + 1, listener[0], 5.0)
    with pytest.raises(TableUnusable):
        PresenceReader(str(tmp_path / "none"), table.instance_id, listener[0], 5.0)
    with pytest.raises(TableUnusable):   # its daemon's socket is gone
        PresenceReader(str(table.path), table.instance_id, str(tmp_path / "gone.sock"), 5.0)
    # a new table at the same path (a restarted daemon) is a new file: a reader of the old one
    # keeps the old one, never reads the new one's slots as its own
    again = PresenceTable(table.path, 64, 0o640)
    assert again.instance_id != table.instance_id
    with pytest.raises(TableUnusable):
        PresenceReader(str(again.path), table.instance_id, listener[0], 5.0)
    again.close()
    table.close()


def test_verify_names_what_differs(tmp_path: Path) -> None:
    table = PresenceTable(tmp_path / "t.presence", 64, 0o600)
    a, b = keys(2)
    table.set(1, a, layout.DRAM, 4096)
    assert table.verify([(1, a, layout.DRAM, 4096), (1, b, 0, -1)]) == []
    assert len(table.verify([(1, a, layout.SSD, -1)])) == 1
    assert len(table.verify([(1, a, layout.DRAM, 4096), (1, b, layout.DRAM, -1)])) == 1
    assert len(table.verify([])) == 1
    assert len(table.verify([(1, a, layout.DRAM, 8192)])) == 1     # its where word names another slot
    table.set(1, b, layout.DRAM)                                    # in DRAM, nothing published
    assert table.verify([(1, a, layout.DRAM, 4096), (1, b, layout.DRAM, -1)]) == []
    assert len(table.verify([(1, a, layout.DRAM, 4096), (1, b, layout.DRAM, 64)])) == 1
    table.close()


@pytest.mark.parametrize("buckets", [1, 4, 64])
def test_a_batch_fills_the_table_slot_for_slot_as_one_block_at_a_time(tmp_path: Path, buckets: int) -> None:
    one = PresenceTable(tmp_path / "one.presence", buckets, 0o600)
    many = PresenceTable(tmp_path / "many.presence", buckets, 0o600)
    rng = np.random.default_rng(buckets)
    for round_ in range(6):
        # small batches (placed a block at a time) and large ones (by numpy) alike
        size = int(rng.integers(1, 40)) if round_ % 2 else int(rng.integers(1, SMALL_BATCH + 1))
        chain = keys(size, salt=round_ % 3)   # rounds 3-5 revisit 0-2's keys
        states = rng.choice([0, layout.DRAM, layout.SSD, layout.PROMOTING], len(chain)).tolist()
        offsets = (rng.integers(0, 1 << 20, len(chain)) * layout.WHERE_UNIT).tolist()
        for key, state, offset in zip(chain, states, offsets):
            one.set(3, key, state, offset)
        many.set_many(3, chain, states, offsets)
        assert one.path.read_bytes()[layout.HEADER.size:] == many.path.read_bytes()[layout.HEADER.size:]
    assert one.overflowed == many.overflowed
    one.close()
    many.close()


def test_threads_sharing_a_reader_may_ask_whether_its_daemon_is_there_at_once(
        tmp_path: Path, listener: tuple[str, socket.socket]) -> None:
    """Found by tests/integration/test_sdk_random.py. Was: the reader's one poll object was
    shared by the client's threads, and two lookups asking at once made one of them raise
    RuntimeError ("concurrent poll() invocation") out of ``Client.lookup``."""
    import threading

    table = PresenceTable(tmp_path / "t.presence", 64, 0o600)
    reader = PresenceReader(str(table.path), table.instance_id, listener[0], 5.0)
    errors: list[BaseException] = []
    answers: list[bool] = []

    def ask() -> None:
        try:
            answers.extend(reader.alive() for _ in range(20_000))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(answers) == 80_000 and all(answers), "a daemon that is there was seen gone"
    reader.close()
    table.close()


@pytest.mark.parametrize("n", [3, 40])
def test_a_reader_locates_blocks_in_dram_and_sees_any_change_before_its_second_look(
        tmp_path: Path, listener: tuple[str, socket.socket], n: int) -> None:
    """The two halves of a load without a lease: where each block's bytes are, and whether every
    block stayed that block's bytes (its where word read again names the same publication)."""
    table = PresenceTable(tmp_path / "t.presence", 1024, 0o600)
    chain = keys(n)
    offsets = [(7 + 3 * i) * layout.WHERE_UNIT for i in range(n)]
    table.set_many(5, chain, [layout.DRAM] * n, offsets)
    reader = PresenceReader(str(table.path), table.instance_id, listener[0], 5.0)
    packed = b"".join(chain)
    located = reader.locate(5, packed, 32, 0)
    assert located is not None and located.hits == n and located.offsets == offsets
    assert reader.confirm(located)
    later = reader.locate(5, packed, 32, n - 1)           # only the last block to read
    assert later is not None and later.hits == n and later.offsets == offsets[-1:]
    assert reader.locate(5, packed + bytes(32), 32, 0).hits == n   # type: ignore[union-attr]
    last = chain[-1]
    # evicted and saved again into the same slot meanwhile: the same offset, another publication
    table.set(5, last, 0)
    table.set(5, last, layout.DRAM, offsets[-1])
    assert not reader.confirm(located)
    located = reader.locate(5, packed, 32, 0)
    assert located is not None and reader.confirm(located)
    table.set(5, last, layout.DRAM, offsets[-1] + layout.WHERE_UNIT)   # moved
    assert not reader.confirm(located)
    table.set(5, last, layout.DRAM, offsets[-1])
    # a block to read that is not in DRAM with its bytes published: no answer; before start: fine
    for state, offset in ((layout.SSD, -1), (layout.PROMOTING, offsets[-1]), (layout.DRAM, -1)):
        table.set(5, last, state, offset)
        assert reader.locate(5, packed, 32, 0) is None
        assert reader.locate(5, packed + keys(1, salt=9)[0], 32, n) == reader.locate(5, packed, 32, n)
        assert reader.locate(5, packed, 32, n).hits == n   # type: ignore[union-attr]
    table.set(5, chain[0], 0)
    gone = reader.locate(5, packed, 32, 0)
    assert gone is not None and gone.hits == 0 and gone.offsets == []
    reader.close()
    table.close()


def test_a_miss_in_an_overflowed_bucket_locates_nothing(tmp_path: Path, listener: tuple[str, socket.socket]) -> None:
    table = PresenceTable(tmp_path / "t.presence", 1, 0o600)   # one bucket: 8 blocks fit
    chain = keys(10)
    table.set_many(1, chain, [layout.DRAM] * 10, [i * layout.WHERE_UNIT for i in range(10)])
    reader = PresenceReader(str(table.path), table.instance_id, listener[0], 5.0)
    assert reader.locate(1, b"".join(chain[:8]), 32, 0).hits == 8   # type: ignore[union-attr]
    assert reader.locate(1, b"".join(chain), 32, 0) is None
    assert table.verify((1, k, layout.DRAM, i * layout.WHERE_UNIT) for i, k in enumerate(chain)) == []
    reader.close()
    table.close()
