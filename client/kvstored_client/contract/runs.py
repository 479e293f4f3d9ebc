"""Runs of blocks that one copy can move: consecutive on the engine's (or the caller's) side and
evenly spaced in the arena.

A batch of small blocks copied one by one pays a Python step (views, a call) per block and
tensor, which costs more than the bytes of a 256 KiB block; a fresh reservation's slots lie
side by side in an arena page and an engine's blocks are often allocated in order, so a batch
is usually a few such runs, each one strided copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` blocks of a batch from its ``start``-th on: engine (or row) ``block_id + i``
    and arena slot ``offset + i * step`` for the i-th of them."""

    start: int
    block_id: int
    offset: int
    count: int


def runs(offsets: Sequence[int] | npt.NDArray[np.integer], step: int,
         block_ids: Sequence[int] | npt.NDArray[np.integer] | None = None) -> list[Run]:
    """The batch's blocks as maximal runs: block ``i`` goes between arena ``offsets[i]`` and
    engine block ``block_ids[i]`` (row ``i`` when None). A run continues while the next offset is
    ``step`` past the last and the next block id one past it; with ``step`` 0 every block is a run
    of its own. Numbers come back as Python ints (a uint32 id times a stride would wrap)."""
    n = len(offsets)
    if n == 0:
        return []
    ids = np.arange(n, dtype=np.int64) if block_ids is None else np.asarray(block_ids, dtype=np.int64)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} block ids for {n} offsets")
    offs = np.asarray(offsets, dtype=np.int64)
    if n == 1 or step == 0:
        return [Run(i, b, o, 1) for i, (b, o) in enumerate(zip(ids.tolist(), offs.tolist()))]
    cut = np.flatnonzero((np.diff(ids) != 1) | (np.diff(offs) != step)) + 1
    bounds = [0, *cut.tolist(), n]
    first_ids, first_offs = ids[bounds[:-1]].tolist(), offs[bounds[:-1]].tolist()
    return [Run(a, b, o, z - a) for a, z, b, o in zip(bounds[:-1], bounds[1:], first_ids, first_offs)]


def smallest_step(offsets: npt.NDArray[np.int64], width: int) -> int:
    """The smallest distance of at least ``width`` from one offset to the next (0 when none is):
    for slots given by the daemon, that of slots side by side, which a caller that does not know
    the arena's slot size can cut :func:`runs` with."""
    gaps = np.diff(offsets)
    gaps = gaps[gaps >= width]
    return int(gaps.min()) if gaps.size else 0
