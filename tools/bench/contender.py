"""What a contender of workload 1 (put/get) is: the interface the driver in :mod:`tools.bench.putget`
calls, shared by kvstored's contenders there and the peers' in :mod:`tools.bench.peer_stores`.

Only numpy: the peers' contenders run from the bench venv.
"""

from __future__ import annotations

import numpy as np


class Impl:
    """A contender. ``src``/``dst`` are (n_blocks, block_bytes) uint8 arrays the driver fills/checks."""

    name = "?"
    src: np.ndarray
    dst: np.ndarray

    def prepare(self, block_bytes: int, n_blocks: int) -> None:
        self.src = faulted((n_blocks, block_bytes))
        self.dst = faulted((n_blocks, block_bytes))

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        raise NotImplementedError

    def get(self, keys: list[bytes], start: int, count: int) -> int:
        """Load ``keys`` into dst rows start..start+count; returns how many blocks arrived."""
        raise NotImplementedError

    def end_puts(self) -> None:
        """A pass of puts is over (timed with it): whatever a put left in flight lands now."""

    def drop(self, keys: list[bytes]) -> None:
        """Forget the keys of an old run (outside the timing); default: rely on eviction."""

    def finish(self) -> None:
        """Free what ``prepare`` made."""
        self.src = self.dst = None  # type: ignore[assignment]

    def close(self) -> None:
        pass


def faulted(shape: tuple[int, int]) -> np.ndarray:
    """A zeroed uint8 array whose every page is already touched."""
    arr = np.empty(shape, dtype=np.uint8)
    arr.fill(0)  # touch every page now, not inside a timed pass
    return arr
