"""The daemon's start-up checks (kvstored/server/app.py) that need no running daemon."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvstored.server.app import StartupError, _prepare_socket


def test_a_file_that_is_not_a_socket_is_never_removed_as_a_stale_socket(tmp_path: Path) -> None:
    """(review) _prepare_socket took whatever sat at server.socket and refused a connection for
    a dead daemon's socket and unlinked it: `kvstored --socket ~/notes.txt` (or a mistyped path
    naming the config file) deleted the user's file and started there."""
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(StartupError, match="not a socket"):
        _prepare_socket(path)
    assert path.read_text() == "keep me"


def test_a_stale_socket_is_still_replaced(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))   # bound, never listening, then closed: what a killed daemon leaves
    assert path.exists()
    _prepare_socket(path)
    assert not path.exists()
