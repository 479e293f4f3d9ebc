"""Where the SDK looks for the daemon when no socket is named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvstored_client import paths


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
