"""(review of 6603721) RegisteredBuffers keeps each tensor's file descriptor open for
check_backing, on top of the one Python's mmap already keeps (mmap dup()s the fd it is given, and
mmap.size() fstat()s it): two descriptors per registered tensor. An engine registers one tensor
per layer and K/V (e.g. 2 x 80), per TP rank and per re-registration; outside systemd the
daemon runs under the usual soft RLIMIT_NOFILE of 1024."""

from __future__ import annotations

import os
from pathlib import Path

from kvstored.buffers import RegisteredBuffers, TensorSource
from kvstored_client.layout import TensorLayout


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_registered_tensor_holds_at_most_one_descriptor(tmp_path: Path) -> None:
    n = 32
    layout = TensorLayout((4, 16, 8), (128, 8, 1), "float16", 0)   # 4 blocks of 16 x 8 halves
    for i in range(n):
        (tmp_path / f"buf{i}").write_bytes(bytes(layout.extent_bytes))
    before = _open_fds()
    buffers = RegisteredBuffers(1, str(tmp_path), [TensorSource(f"buf{i}", 0, layout) for i in range(n)])
    try:
        held = _open_fds() - before
        assert held <= n, f"{held} descriptors held for {n} tensors"
    finally:
        buffers.close()
    assert _open_fds() == before


def test_a_failed_registration_closes_what_it_opened(tmp_path: Path) -> None:
    layout = TensorLayout((4, 16, 8), (128, 8, 1), "float16", 0)
    (tmp_path / "ok").write_bytes(bytes(layout.extent_bytes))
    (tmp_path / "short").write_bytes(bytes(10))
    before = _open_fds()
    try:
        RegisteredBuffers(1, str(tmp_path), [TensorSource("ok", 0, layout), TensorSource("short", 0, layout)])
    except Exception:
        pass
    else:
        raise AssertionError("a short file was accepted")
    assert _open_fds() == before
