"""Punching holes: the range's disk space goes back, its bytes read as zeros, the rest is kept."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fsprobe import can_punch_holes
from kvstored.tiers import holes


def test_a_punched_range_gives_its_space_back_and_reads_zeros(tmp_path: Path) -> None:
    if not can_punch_holes(tmp_path):
        pytest.skip("this filesystem cannot punch holes")
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * (3 * 4096))   # 3 MiB
    before = path.stat().st_blocks
    fd = os.open(path, os.O_RDWR)
    try:
        assert holes.punch_hole(fd, 1 << 20, 1 << 20)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == 3 << 20                          # the size stays
    assert data[1 << 20:2 << 20] == bytes(1 << 20)        # the hole reads as zeros
    assert data[:1 << 20] == data[2 << 20:] == bytes(range(256)) * 4096
    assert (before - path.stat().st_blocks) * 512 >= 1 << 20   # and its disk space went back


def test_a_bad_descriptor_is_an_error_not_unsupported(tmp_path: Path) -> None:
    if holes._fallocate is None:
        pytest.skip("no fallocate in this C library")
    with pytest.raises(OSError) as info:
        holes.punch_hole(10_000, 0, 4096)
    assert info.value.errno == errno.EBADF


def test_without_fallocate_nothing_is_punched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holes, "_fallocate", None)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDWR)
    try:
        assert holes.punch_hole(fd, 0, 4096) is False
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 8192
