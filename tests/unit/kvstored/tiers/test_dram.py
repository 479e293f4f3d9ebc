"""The DRAM arena's file: the sweep of dead daemons' arenas spares live ones."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from kvstored.tiers.dram import Arena, sweep_stale_arenas


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_sweep_spares_an_arena_a_live_daemon_holds(tmp_path: Path) -> None:
    """Regression: a daemon in another PID namespace (a container sharing /dev/shm) has a pid
    this one cannot see; the sweep deleted its live arena. A live daemon holds its arena locked."""
    path = tmp_path / f"kvstored-{dead_pid()}-abcd1234"
    path.write_bytes(b"\0" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)    # as Arena does for its lifetime
        assert sweep_stale_arenas(str(tmp_path)) == [] and path.exists()
    finally:
        os.close(fd)
    assert sweep_stale_arenas(str(tmp_path)) == [path.name] and not path.exists()


def test_an_arena_is_locked_until_closed(tmp_path: Path) -> None:
    arena = Arena(str(tmp_path), 1 << 20, prefault=True)
    # made under a hidden name, locked, then renamed: only the locked arena is ever visible
    assert [p.name for p in tmp_path.iterdir()] == [arena.path.name]
    fd = os.open(arena.path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = False
        except BlockingIOError:
            locked = True
        assert locked
        arena.close()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # free now
    finally:
        os.close(fd)
    assert not arena.path.exists()
