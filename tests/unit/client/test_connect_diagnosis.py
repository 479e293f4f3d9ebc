"""Why ``Client()`` could not reach a daemon, told from the socket itself (connect's errno), not
from the text of grpc's own error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import kvstored
from kvstored_client import connection


def test_a_plain_connect_tells_what_listens(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    assert isinstance(connection._connect_error(f"unix:{path}"), FileNotFoundError)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        assert connection._connect_error(f"unix:{path}") is None
    assert connection._connect_error("dns:localhost:notaport") is not None


def test_a_socket_this_user_may_not_open_is_said_to_be_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(root opens any socket, so the refusal is the probe's answer here)"""
    monkeypatch.setattr(connection, "_connect_error", lambda target: PermissionError(13, "Permission denied"))
    with pytest.raises(kvstored.DaemonNotRunning, match="permission denied on .*group kvstored"):
        kvstored.Client(str(tmp_path / "kv.sock"), timeout_s=2)


def test_no_socket_at_all_is_no_daemon(tmp_path: Path) -> None:
    with pytest.raises(kvstored.DaemonNotRunning, match="no kvstored daemon answers") as info:
        kvstored.Client(str(tmp_path / "kv.sock"), timeout_s=2)
    assert info.value.reason == "UNAVAILABLE"
