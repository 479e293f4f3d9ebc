"""What the randomized tests of the store and of the cluster share: the bytes a write stores, the
client-side record of leases and sessions, and a runner that sweeps seeds from the command line."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstored.index import Block


def payload(key: bytes, ns: int, version: int, nbytes: int) -> bytes:
    """Bytes no other write produces: the key, the namespace and a version, repeated."""
    return (key[:7] + bytes([ns]) + version.to_bytes(8, "little")) * (nbytes // 16)


class Broken(AssertionError):
    """An invariant the test checks does not hold (the message names the seed and the last ops)."""


@dataclass
class Tracked:
    """A lease or reservation the test (the client) holds."""

    lease_id: int
    session: str
    ns: int                     # index into the test's namespaces
    keys: list[bytes]           # the blocks it covers, in chain order
    offsets: list[int]
    expected: list[bytes]       # their bytes (reservations: what the client wrote)
    reservation: bool
    born: tuple[float, float]   # the clock when its request started and when it returned
    ttl: float


@dataclass
class ClientSession:
    session_id: str
    buffers: dict[int, tuple[int, Any]] = field(default_factory=dict)   # ns -> (buffers_id, SharedTensor)
    free_rows: dict[int, list[int]] = field(default_factory=dict)       # ns -> free row ranges
    closed: bool = False


def under_ssd(block: Block) -> bool:
    """Whether every ancestor of ``block`` has an SSD copy (what a restart can rebuild it under)."""
    parent = block.parent
    while parent is not None:
        if not parent.on_ssd:
            return False
        parent = parent.parent
    return True


def sweep(run_seed: Callable[[Path, int, int], None], default_steps: int) -> None:
    """``python <test> FIRST COUNT [STEPS] [v]``: run seeds FIRST.. in fresh directories, print each
    failure (whole with ``v``) and the failing seeds."""
    first, count = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else default_steps
    verbose = len(sys.argv) > 4
    failed = []
    for seed in range(first, first + count):
        with tempfile.TemporaryDirectory() as d:
            try:
                run_seed(Path(d), seed, steps)
            except Broken as exc:
                failed.append(seed)
                print(str(exc) if verbose else str(exc).splitlines()[0], flush=True)
            except Exception as exc:
                failed.append(seed)
                print(f"seed {seed}: {exc!r}", flush=True)
    print(f"{count - len(failed)}/{count} passed; failing seeds: {failed}")
