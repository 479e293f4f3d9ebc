"""Shared-memory tensors of the SDK (review): allocation failures, shapes, and the dtype a view is
registered under."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstored_client import shm
from kvstored_client.contract.layout import layout_signature


def test_a_failed_allocation_leaves_no_file_behind(tmp_path: Path) -> None:
    """SharedTensor creates the file with O_CREAT|O_EXCL, then ftruncate/mmap; when either fails
    (too large, out of memory) the finalizer that unlinks it is not set up yet, so the file stays
    in /dev/shm for good."""
    with pytest.raises(OSError):
        shm.SharedTensor((1 << 62,), "uint8", shm_dir=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("shape", [(-1, 4), (3, -2), (-1,)])
def test_a_negative_dimension_is_rejected(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """Was accepted: nbytes came out negative, the file got 1 byte and the object claimed the
    shape."""
    with pytest.raises(ValueError):
        shm.SharedTensor(shape, "uint8", shm_dir=str(tmp_path))


def test_numpy_and_torch_views_of_a_bfloat16_buffer_register_the_same_layout() -> None:
    """``SharedTensor.numpy()`` shows bfloat16 as uint16 (numpy has no bfloat16), and ``describe``
    then names the layout ``uint16[...]`` while the torch view of the same bytes is
    ``bfloat16[...]``: the layout signature enters the namespace, so an engine registering one view
    never finds blocks saved through the other (same model, same bytes, split namespaces)."""
    pytest.importorskip("torch")
    t = shm.empty((2, 4, 16, 2, 8), "bfloat16")
    try:
        via_numpy = shm.describe(t.numpy(), 1).layout
        via_torch = shm.describe(t.torch(), 1).layout
        assert layout_signature([via_numpy]) == layout_signature([via_torch])
    finally:
        t.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_tensor_larger_than_the_free_shared_memory_is_refused(tmp_path: Path) -> None:
    """SharedTensor only ftruncate()d its file and mapped it with MAP_POPULATE, which does not fail
    when tmpfs runs out: on a full /dev/shm the tensor came back sparse, and the first write to a
    missing page (the engine's, or the daemon's copy of a load, which killed the daemon) was a
    SIGBUS. Run in a child: on the old code the write below kills it."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        code = ("import sys\n"
                "from kvstored_client import shm\n"
                "try:\n"
                f"    t = shm.SharedTensor((4 << 20,), 'uint8', shm_dir={str(mnt)!r})\n"
                "except OSError as exc:\n"
                "    print('refused', exc.errno)\n"
                "    sys.exit(0)\n"
                "t.bytes[:] = 1\n"
                "print('written')\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}   # this checkout's SDK
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0 and out.stdout.startswith("refused"), (out.returncode, out.stdout, out.stderr)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_buffer_file_is_group_read_write_whatever_the_umask(tmp_path: Path) -> None:
    """Under the systemd unit the daemon runs as user kvstored and maps an engine's buffer files
    as a member of their group: os.open's 0o660 went through the engine's umask (022 by
    default), so the file came out 0640 and the daemon's O_RDWR open was refused."""
    old = os.umask(0o022)
    try:
        t = shm.SharedTensor((4, 16), "uint8", shm_dir=str(tmp_path))
    finally:
        os.umask(old)
    assert t.path.stat().st_mode & 0o777 == 0o660


def test_a_buffer_file_belongs_to_the_daemons_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file's group was the engine's own primary group, which the daemon's user is not in:
    README's "engine processes join group kvstored" was not enough for register_buffers."""
    if os.geteuid() == 0:
        gid = 65534
    else:
        others = [g for g in os.getgroups() if g != os.getegid()]
        if not others:
            pytest.skip("needs a supplementary group to hand the file to")
        gid = others[0]
    monkeypatch.setattr(shm, "_daemon_gid", lambda: gid)
    t = shm.SharedTensor((4, 16), "uint8", shm_dir=str(tmp_path))
    assert t.path.stat().st_gid == gid
    monkeypatch.setattr(shm, "_daemon_gid", lambda: None)   # no such group here: the file stays as made
    assert shm.SharedTensor((4, 16), "uint8", shm_dir=str(tmp_path)).path.stat().st_gid == os.getegid()


def test_views_keep_their_buffer_and_its_file(tmp_path: Path) -> None:
    """Was: ``shm.empty(...).torch()`` (or ``.numpy()``) alone lost its SharedTensor at once: its
    file was unlinked and ``describe`` (register_buffers) said "not in shared memory: allocate it
    with kvstored.shm.empty()" of a tensor so allocated; a view kept after the SharedTensor was
    dropped could not be registered again after a daemon restart."""
    import gc

    import torch

    views = [shm.SharedTensor((2, 4, 16, 2, 4), dtype, str(tmp_path)).torch() for dtype in ("bfloat16", "float16")]
    arrays = [shm.SharedTensor((3, 8), "float32", str(tmp_path)).numpy()]
    gc.collect()
    assert len(list(tmp_path.iterdir())) == 3
    for v in views:
        place = shm.describe(v, 1)
        assert (tmp_path / place.shm_name).exists() and place.layout.num_blocks == 4
    v = views[1]
    v[1, 2] = torch.ones(v.shape[2:])
    raw = np.memmap(tmp_path / shm.describe(v, 1).shm_name, dtype=np.float16, mode="r").reshape(v.shape)
    assert (raw[1, 2] == 1).all() and raw.sum() == v[1, 2].numel()
    assert shm.describe(arrays[0], 0).layout.shape == (3, 8)
    del views, arrays, v, raw
    gc.collect()
    assert list(tmp_path.iterdir()) == []   # the last view gone, the file goes too


def test_buffer_files_of_dead_processes_are_swept_live_ones_kept(tmp_path: Path) -> None:
    """Was: an engine killed with SIGKILL (or OOM-killed) left its whole KV pool in /dev/shm for
    good; nothing ever removed it (the daemon sweeps only its own arenas)."""
    import fcntl
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    allocate = (f"from kvstored_client import shm; t = shm.SharedTensor((1 << 16,), 'uint8', {str(tmp_path)!r}); "
                "import os, signal, sys; print(t.name, flush=True); ")
    killed = subprocess.run([sys.executable, "-c", allocate + "os.kill(os.getpid(), signal.SIGKILL)"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    dead_name = killed.stdout.split()[0]
    assert (tmp_path / dead_name).exists()
    live = subprocess.Popen([sys.executable, "-c", allocate + "sys.stdin.read()"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert live.stdout is not None
        live_name = live.stdout.readline().split()[0]
        # a dead pid's file that a process still holds locked (one in another PID namespace)
        locked = tmp_path / f"kvstored-buf-{killed_pid_never_alive()}-00aa11bb22cc"
        locked.write_bytes(b"x")
        holder = os.open(locked, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_SH)
        try:
            # the first allocation of a new process (an engine starting) in the directory
            mine = subprocess.run([sys.executable, "-c", allocate + "print(*os.listdir(os.path.dirname(t.path)))"],
                                  capture_output=True, text=True, env=env, timeout=60)
            first, names = mine.stdout.splitlines()
            assert dead_name not in names.split()
            assert {live_name, locked.name, first} <= set(names.split())
        finally:
            os.close(holder)
        assert not (tmp_path / first).exists()   # its own exit removed it
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(30)
    deadline = time.monotonic() + 10
    while (tmp_path / live_name).exists() and time.monotonic() < deadline:   # its exit unlinks it
        time.sleep(0.05)
    assert not (tmp_path / live_name).exists()


def killed_pid_never_alive() -> int:
    """A pid no process has now: one of a child that has exited and been reaped."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=60)
    return int(proc.stdout)
