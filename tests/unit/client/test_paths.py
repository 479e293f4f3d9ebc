"""Where the SDK looks for the daemon when no socket is named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import kvstored
from kvstored_client.contract import paths


def test_a_tmp_socket_directory_of_another_user_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $XDG_RUNTIME_DIR the user default is /tmp/kvstored-$UID/kvstored.sock, a name any
    local user can create first. The daemon refuses such a directory ("belongs to another user");
    the SDK must not connect there either (and map that stranger's arena as its KV cache), least
    of all in preference to the system daemon's /run/kvstored/kvstored.sock."""
    fake_uid = 4_000_000 + os.getpid() % 100_000      # a /tmp name no real session uses
    monkeypatch.setattr(os, "getuid", lambda: fake_uid)
    monkeypatch.delenv("KVSTORED_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    planted = Path(f"/tmp/kvstored-{fake_uid}")
    planted.mkdir()
    try:
        (planted / "kvstored.sock").write_bytes(b"")   # stands in for a stranger's listening socket
        if os.geteuid() == 0:
            os.chown(planted, 65534, 65534)            # owned by nobody (root counts as trusted)
        # else: owned by the real uid, which is another user than fake_uid
        assert paths.default_socket_path() == str(planted / "kvstored.sock")
        assert paths.discover_socket_path() != str(planted / "kvstored.sock")
    finally:
        shutil.rmtree(planted)


def test_a_symlink_planted_at_the_tmp_socket_directory_is_not_trusted(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """(review of 8eebe3d) _ours() stats the directory through symlinks: another user links
    /tmp/kvstored-$UID to a root-owned directory where they may create files (/tmp itself, sticky
    but world-writable, or /dev/shm) and puts their socket there as kvstored.sock; the SDK sees
    root's directory and connects to the stranger's daemon."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the link and the socket to another user")
    fake_uid = 4_000_000 + os.getpid() % 100_000
    monkeypatch.setattr(os, "getuid", lambda: fake_uid)
    monkeypatch.delenv("KVSTORED_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    target = tmp_path / "world-writable-root-dir"      # stands in for /tmp or /dev/shm
    target.mkdir()
    os.chown(target, 0, 0)
    target.chmod(0o1777)
    (target / "kvstored.sock").write_bytes(b"")         # the stranger's socket
    os.chown(target / "kvstored.sock", 65534, 65534)
    planted = Path(f"/tmp/kvstored-{fake_uid}")
    planted.symlink_to(target)
    os.lchown(planted, 65534, 65534)
    try:
        assert paths.discover_socket_path() != str(planted / "kvstored.sock")
    finally:
        planted.unlink()


def test_a_socket_path_too_long_for_a_unix_socket_is_named_as_such() -> None:
    """The SDK said "Failed to create channel ... the target uri is not valid" (grpc's words) for a
    socket path past 107 bytes: now its length and the limit, before any connection is tried."""
    long = "/tmp/" + "d" * 100 + "/kv.sock"
    with pytest.raises(kvstored.InvalidArgument) as err:
        kvstored.Client(long)
    assert "113 bytes" in str(err.value) and str(paths.MAX_SOCKET_PATH_BYTES) in str(err.value)
