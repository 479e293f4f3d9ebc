"""(review of 8eebe3d) serve() removes the socket file at the end only if _file_id still matches
the one it bound. (st_dev, st_ino) does not tell a successor's socket from ours: gRPC unlinks our
socket when the listener closes, and on ext4 (a /tmp/kvstored-$UID socket) the next socket
created in the directory usually gets the freed inode number back."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from kvstored.server.app import StartupError, _file_id, _prepare_socket


def test_a_successor_socket_on_the_same_path_has_another_identity(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    ours = socket.socket(socket.AF_UNIX)
    ours.bind(str(path))
    mine = _file_id(path)
    ours.close()
    path.unlink()                          # gRPC's listener shutdown does this
    time.sleep(0.05)
    successor = socket.socket(socket.AF_UNIX)
    successor.bind(str(path))              # another daemon takes the path
    try:
        assert _file_id(path) != mine, "the successor's socket is taken for ours (inode number reused)"
    finally:
        successor.close()


def test_the_daemon_refuses_a_socket_directory_that_is_a_strangers_symlink(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """(review of e133f56) the SDK now refuses a /tmp/kvstored-$UID that is a symlink (lstat), but
    the daemon's _prepare_socket still stat()s through it: a stranger's link to a root-owned
    world-writable directory passes as root's, the daemon listens there, and the SDK (which
    refuses the same path) never finds it. Both sides must judge the same directory."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the link to another user")
    fake_uid = 4_000_000 + os.getpid() % 100_000
    monkeypatch.setattr(os, "getuid", lambda: fake_uid)
    target = tmp_path / "world-writable-root-dir"      # stands in for /tmp or /dev/shm
    target.mkdir()
    os.chown(target, 0, 0)
    target.chmod(0o1777)
    planted = tmp_path / f"kvstored-{fake_uid}"
    planted.symlink_to(target)
    os.lchown(planted, 65534, 65534)
    with pytest.raises(StartupError):
        _prepare_socket(planted / "kvstored.sock")


def test_the_daemon_and_the_sdk_judge_a_socket_directory_alike(tmp_path: Path) -> None:
    """(review of ca0006f) the daemon now accepts a socket directory that is a symlink of this
    user (or root) to a directory of this user (or root), but the SDK's _ours() refuses every
    symlink (lstat, S_ISDIR): the daemon listens at the default path and the SDK, taking it for a
    planted one, goes to the system socket instead."""
    from kvstored_client.contract.paths import _ours
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "kvstored-link"
    link.symlink_to(real)                               # ours: made by this user
    try:
        _prepare_socket(link / "kvstored.sock")
        daemon_accepts = True
    except StartupError:
        daemon_accepts = False
    assert daemon_accepts == _ours(str(link)), \
        f"the daemon {'accepts' if daemon_accepts else 'refuses'} {link}, the SDK does not"
