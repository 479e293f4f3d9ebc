"""(review of 6603721) RegisteredBuffers keeps each tensor's file descriptor open for
check_backing, on top of the one Python's mmap already keeps (mmap dup()s the fd it is given, and
mmap.size() fstat()s it): two descriptors per registered tensor. An engine registers one tensor
per layer and K/V (e.g. 2 x 80), per TP rank and per re-registration; outside systemd the
daemon runs under the usual soft RLIMIT_NOFILE of 1024."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstored.buffers import RegisteredBuffers, TensorSource
from kvstored_client.contract.errors import InvalidArgument
from kvstored_client.contract.layout import TensorLayout


def _open_fds(under: Path) -> int:
    """Descriptors of this process open on files in ``under``: counting them all let a descriptor
    of an earlier test, closed meanwhile by the garbage collector or a thread, fail these tests."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # closed since the listing (the listing's own descriptor, for one)
            continue
        held += target.startswith(f"{under.resolve()}/")
    return held


def test_a_registered_tensor_holds_at_most_one_descriptor(tmp_path: Path) -> None:
    n = 32
    layout = TensorLayout((4, 16, 8), (128, 8, 1), "float16", 0)   # 4 blocks of 16 x 8 halves
    for i in range(n):
        (tmp_path / f"buf{i}").write_bytes(bytes(layout.extent_bytes))
    before = _open_fds(tmp_path)
    buffers = RegisteredBuffers(1, str(tmp_path), [TensorSource(f"buf{i}", 0, layout) for i in range(n)])
    try:
        held = _open_fds(tmp_path) - before
        assert 0 < held <= n, f"{held} descriptors held for {n} tensors"
    finally:
        buffers.close()
    assert _open_fds(tmp_path) == before


def test_a_failed_registration_closes_what_it_opened(tmp_path: Path) -> None:
    layout = TensorLayout((4, 16, 8), (128, 8, 1), "float16", 0)
    (tmp_path / "ok").write_bytes(bytes(layout.extent_bytes))
    (tmp_path / "short").write_bytes(bytes(10))
    before = _open_fds(tmp_path)
    with pytest.raises(InvalidArgument, match=r"tensors\[1\]: tensor extends to byte .* 'short' has 10"):
        RegisteredBuffers(1, str(tmp_path), [TensorSource("ok", 0, layout), TensorSource("short", 0, layout)])
    assert _open_fds(tmp_path) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_sparse_file_on_a_full_tmpfs_is_refused_not_mapped(tmp_path: Path) -> None:
    """A buffer file made with ftruncate alone (an engine's own shared memory, or any file made
    while /dev/shm was full) has holes, and MAP_POPULATE does not fail when tmpfs cannot fill them:
    the registration passed and the daemon's first copy touching a hole died of SIGBUS. The copy
    runs in a child: on the old code it is killed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        code = f"""
import sys
import numpy as np
from kvstored.buffers import RegisteredBuffers, TensorSource
from kvstored_client.contract.errors import InvalidArgument
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.layout import TensorLayout
with open({str(mnt / "sparse")!r}, "wb") as fh:
    fh.truncate(4 << 20)
layout = TensorLayout((4, 1 << 20), (1 << 20, 1), "uint8", 0)
try:
    buffers = RegisteredBuffers(1, {str(mnt)!r}, [TensorSource("sparse", 0, layout)])
except KVStoreError as exc:
    print("refused:", type(exc).__name__, exc)
    sys.exit(0)
t = buffers.tensors[0]
t.host[:] = 1   # what a load's copy into the engine's buffers does
print("copied")
"""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
        assert out.stdout.startswith("refused: ResourceExhausted"), out.stdout
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a ramfs needs root")
def test_a_file_on_a_filesystem_without_fallocate_is_not_written_by_the_registration(tmp_path: Path) -> None:
    """(review of b26957a) The registration reserved the tensor's pages with os.posix_fallocate. On
    a filesystem without fallocate (ramfs here) glibc emulates it: it reads one byte of every 4 KiB
    block of the engine's buffers and writes a zero back where it read one, a read and a write per
    page on the daemon's event loop, racing the engine, whose byte written between the two is
    lost. The daemon must not write into a client's buffers to register them."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t ramfs is not permitted here")
    try:
        layout = TensorLayout((64, 1 << 12), (1 << 12, 1), "uint8", 0)   # 64 blocks of a page each
        path = mnt / "engine-kv"
        with open(path, "wb") as fh:
            fh.truncate(layout.extent_bytes)
        os.utime(path, (1_000_000, 1_000_000))
        buffers = RegisteredBuffers(1, str(mnt), [TensorSource("engine-kv", 0, layout)])
        try:
            assert os.stat(path).st_mtime == 1_000_000, "the registration wrote into the engine's buffers"
            buffers.tensors[0].host[:] = 7   # and the mapping works as before
            assert path.read_bytes() == bytes([7]) * layout.extent_bytes
        finally:
            buffers.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_registration_past_the_daemons_open_file_limit_is_resource_exhausted(tmp_path: Path) -> None:
    """(RPC review) With the daemon's descriptors used up (two engines' worth of tensors under the
    soft RLIMIT_NOFILE of 1024), opening a tensor's file failed with EMFILE and the client was told
    INVALID_ARGUMENT "cannot open ...": its input was fine, the daemon was out of a resource. Run
    in a child, under a low limit of its own."""
    code = f"""
import resource, sys
from kvstored.buffers import RegisteredBuffers, TensorSource
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.layout import TensorLayout
layout = TensorLayout((4, 16, 8), (128, 8, 1), "float16", 0)
for i in range(64):
    with open({str(tmp_path)!r} + f"/buf{{i}}", "wb") as fh:
        fh.write(bytes(layout.extent_bytes))
resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    RegisteredBuffers(1, {str(tmp_path)!r}, [TensorSource(f"buf{{i}}", 0, layout) for i in range(64)])
except KVStoreError as exc:
    print("refused:", type(exc).__name__, exc)
    sys.exit(0)
print("registered")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert out.stdout.startswith("refused: ResourceExhausted"), out.stdout
