"""The DRAM arena's file: the sweep of dead daemons' arenas spares live ones."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_prefault_reports_its_advance_and_a_stop_during_it_leaves_no_file(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-faulting a large arena is one long step (~45 s for 12 GiB here): it reports after each
    chunk, and whatever the report raises (a stop asked for) ends it with no arena file left."""
    from kvstored.tiers import dram

    monkeypatch.setattr(dram, "PREFAULT_CHUNK", 1 << 20)
    seen: list[tuple[int, int]] = []
    arena = Arena(str(tmp_path), 4 << 20, progress=lambda done, total: seen.append((done, total)))
    arena.close()
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1] == (4 << 20, 4 << 20)
    assert len(seen) == 8   # 4 chunks reserved, then 4 populated

    def stop_at_the_fifth(done: int, total: int) -> None:
        if done > (2 << 20):
            raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
        Arena(str(tmp_path), 4 << 20, progress=stop_at_the_fifth)
    assert list(tmp_path.iterdir()) == [], "an arena file was left behind"


SMAPS = """\
7f0000000000-7f0000400000 rw-s 00000000 00:2f 5                          /dev/shm/kvstored-1-ab
Rss:                4096 kB
ShmemPmdMapped:     2048 kB
FilePmdMapped:         0 kB
VmFlags: rd wr sh mr mw me ms sd
7f0000400000-7f0000800000 rw-p 00000000 00:00 0
Rss:                4096 kB
ShmemPmdMapped:     4096 kB
"""


def test_huge_pages_are_counted_for_the_mapping_that_holds_the_address(tmp_path: Path) -> None:
    from kvstored.tiers.dram import mapped_huge_bytes

    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert mapped_huge_bytes(0x7F0000001000, str(smaps)) == 2048 << 10
    assert mapped_huge_bytes(0x7F0000400000, str(smaps)) == 4096 << 10
    assert mapped_huge_bytes(0x7F0000800000, str(smaps)) is None   # no mapping holds it
    assert mapped_huge_bytes(0x7F0000001000, str(tmp_path / "missing")) is None


def test_an_arena_on_a_tmpfs_mounted_for_huge_pages_is_on_huge_pages(tmp_path: Path) -> None:
    """The arena in a tmpfs with huge=within_size (README, Huge pages) is mapped with 2 MiB
    pages; in a plain directory the count is still reported."""
    arena = Arena(str(tmp_path), 8 << 20, prefault=True)
    try:
        assert arena.huge_page_bytes() is not None
    finally:
        arena.close()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to make a mount namespace with a tmpfs of its own")
    mount = tmp_path / "huge"
    mount.mkdir()
    script = ("import sys; from kvstored.tiers.dram import Arena; a = Arena(sys.argv[1], 64 << 20); "
              "print(a.huge_page_bytes()); a.close()")
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs -o size=128m,huge=within_size none {mount} && "
                            f"exec {sys.executable} -c '{script}' {mount}"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode and "mount" in probe.stderr + probe.stdout and not probe.stdout.strip():
        pytest.skip(f"no tmpfs can be mounted here (a mount namespace needs CAP_SYS_ADMIN): {probe.stderr.strip()}")
    assert probe.returncode == 0, probe.stderr
    assert int(probe.stdout) >= 32 << 20   # (a fragmented host may give some 4 KiB pages)
