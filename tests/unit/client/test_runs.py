"""Runs of blocks a copy moves at once (kvstored_client.contract.runs), and the SDK's arena copies by runs."""

from __future__ import annotations

import numpy as np
import pytest

from kvstored_client.client import copy_rows
from kvstored_client.contract.runs import Run, runs


def test_adjacent_slots_of_consecutive_blocks_are_one_run() -> None:
    assert runs([0, 64, 128], 64, [5, 6, 7]) == [Run(0, 5, 0, 3)]
    assert runs([128, 192], 64) == [Run(0, 0, 128, 2)]   # rows 0, 1 of the caller's array


def test_a_run_breaks_where_either_side_stops_being_contiguous() -> None:
    assert runs([0, 64, 128, 192], 64, [1, 2, 9, 10]) == [Run(0, 1, 0, 2), Run(2, 9, 128, 2)]
    assert runs([0, 64, 320, 384], 64, [1, 2, 3, 4]) == [Run(0, 1, 0, 2), Run(2, 3, 320, 2)]
    assert runs([64, 0], 64, [0, 1]) == [Run(0, 0, 64, 1), Run(1, 1, 0, 1)]   # slots descending
    assert runs([0, 64], 64, [1, 0]) == [Run(0, 1, 0, 1), Run(1, 0, 64, 1)]   # ids descending


def test_a_single_block_no_blocks_and_no_step() -> None:
    assert runs([4096], 64, [3]) == [Run(0, 3, 4096, 1)]
    assert runs([], 64, []) == []
    assert runs([0, 64], 0, [0, 1]) == [Run(0, 0, 0, 1), Run(1, 1, 64, 1)]


def test_numbers_come_back_as_python_ints_that_do_not_wrap() -> None:
    ids = np.array([2**32 - 2, 2**32 - 1], dtype=np.uint32)
    (run,) = runs([2**40, 2**40 + 64], 64, ids)
    assert run == Run(0, 2**32 - 2, 2**40, 2)
    assert type(run.block_id) is int and type(run.offset) is int and type(run.start) is int


def test_ids_and_offsets_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 block ids for 3 offsets"):
        runs([0, 64, 128], 64, [0, 1])


# slots of 100-byte rows 128 apart (a 64-byte-aligned slot), in a 16-slot arena
SLOTS_BY_CASE = {
    "side by side": [0, 1, 2, 3],
    "broken mid-run": [4, 5, 9, 10, 11],
    "nothing adjacent": [7, 2, 12],
    "a single slot at the arena's end": [15],
    "a run ending at the arena's end": [13, 14, 15],
    "descending": [3, 2, 1],
    "two apart, then side by side": [0, 2, 4, 5],
}


@pytest.mark.parametrize("to_arena", [True, False], ids=["save", "load"])
@pytest.mark.parametrize("case", list(SLOTS_BY_CASE))
def test_copy_rows_moves_exactly_each_rows_bytes(case: str, to_arena: bool) -> None:
    rng = np.random.default_rng(30)
    arena = rng.integers(0, 256, 16 * 128, dtype=np.uint8)
    offsets = [s * 128 for s in SLOTS_BY_CASE[case]]
    rows = rng.integers(0, 256, (len(offsets) + 2, 100), dtype=np.uint8)   # more rows than slots
    want_arena, want_rows = arena.copy(), rows.copy()
    for i, offset in enumerate(offsets):   # the per-row copy it replaces
        if to_arena:
            want_arena[offset: offset + 100] = rows[i]
        else:
            want_rows[i] = arena[offset: offset + 100]
    copy_rows(arena, offsets, rows, to_arena)
    assert np.array_equal(arena, want_arena) and np.array_equal(rows, want_rows)


@pytest.mark.parametrize("blocks", [1, 2], ids=["one block", "two blocks"])
@pytest.mark.parametrize("offset", [-128, 15 * 128 + 29], ids=["before", "past the end"])
def test_copy_rows_refuses_a_slot_outside_the_arena(offset: int, blocks: int) -> None:
    arena = np.zeros(16 * 128, np.uint8)
    with pytest.raises(ValueError, match="outside its 2048-byte arena"):
        copy_rows(arena, [0, offset][-blocks:], np.ones((blocks, 100), np.uint8), to_arena=True)
    assert not arena.any()
