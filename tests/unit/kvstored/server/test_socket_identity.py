"""(review of 8eebe3d) serve() removes the socket file at the end only if _file_id still matches
the one it bound. (st_dev, st_ino) does not tell a successor's socket from ours: gRPC unlinks our
socket when the listener closes, and on ext4 (a /tmp/kvstored-$UID socket) the next socket
created in the directory usually gets the freed inode number back."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from kvstored.server.app import _file_id


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
