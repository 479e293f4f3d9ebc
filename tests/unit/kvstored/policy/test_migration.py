"""The handover ledger: pushed chunk by chunk, the decode node waits after the prefill for about
one chunk's transfer when the link outpaces the prefill, and for the whole transfer when the
prefill is instant; pulled after the prefill, it always waits for the whole transfer."""

from __future__ import annotations

import itertools

import pytest

from kvstored.policy.cost import ModelShape
from kvstored.policy.migration import Link, chunk_ends, kv_ready_pipelined, kv_ready_whole, prefill_schedule

BLOCKS, CHUNK, NBYTES = 1024, 64, 1 << 20
LINK = Link(latency_s=0.001, bytes_per_s=1e9)


def schedule() -> list[float]:
    return prefill_schedule(ModelShape.llama3_8b(), BLOCKS, 16, CHUNK, 4e14)


def test_a_prefill_is_cut_into_chunks_the_last_one_short() -> None:
    assert chunk_ends(10, 4) == [4, 8, 10]
    assert chunk_ends(8, 4) == [4, 8]
    with pytest.raises(ValueError):
        chunk_ends(0, 4)


def test_later_chunks_cost_more() -> None:
    times = schedule()
    steps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert all(later > earlier for earlier, later in itertools.pairwise(steps))


def test_pulled_after_the_prefill_the_whole_transfer_is_waited_for() -> None:
    s = schedule()
    assert kv_ready_whole(s, BLOCKS, NBYTES, LINK) == pytest.approx(s[-1] + 0.001 + BLOCKS * NBYTES / 1e9)


def test_pushed_chunk_by_chunk_the_transfer_hides_under_the_prefill() -> None:
    s = schedule()
    piped = kv_ready_pipelined(s, BLOCKS, CHUNK, NBYTES, LINK)
    assert s[-1] < piped < kv_ready_whole(s, BLOCKS, NBYTES, LINK)
    fast = Link(latency_s=0.001, bytes_per_s=1e12)
    assert kv_ready_pipelined(s, BLOCKS, CHUNK, NBYTES, fast) == pytest.approx(s[-1] + CHUNK * NBYTES / 1e12 + 0.001)


def test_an_instant_prefill_leaves_only_the_transfer() -> None:
    instant = [0.0] * len(schedule())
    assert kv_ready_pipelined(instant, BLOCKS, CHUNK, NBYTES, LINK) == pytest.approx(0.001 + BLOCKS * NBYTES / 1e9)
