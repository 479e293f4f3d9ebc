"""What the filesystem under a test's directory can do, for tests that depend on it."""

from __future__ import annotations

import os
from pathlib import Path

from kvstored.tiers.holes import punch_hole


def can_punch_holes(directory: Path) -> bool:
    """Whether files in ``directory`` can give a byte range's disk space back (punched holes)."""
    probe = directory / ".punch-probe"
    probe.write_bytes(b"x" * (1 << 20))
    fd = os.open(probe, os.O_RDWR)
    try:
        return punch_hole(fd, 0, 1 << 20)
    finally:
        os.close(fd)
        probe.unlink()
