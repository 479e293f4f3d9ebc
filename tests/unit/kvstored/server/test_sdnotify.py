"""The systemd notification sender: one datagram per state, and never a blocked caller."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kvstored.server import sdnotify


def test_a_listener_that_stops_reading_never_blocks_the_sender(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A datagram socket queues only a few messages (net.unix.max_dgram_qlen); the daemon sends
    from its event loop, so once the queue is full a notification is dropped, not waited for."""
    path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    sent: list[bool] = []
    sender = threading.Thread(target=lambda: sent.extend(sdnotify.notify(f"STATUS={i}") for i in range(200)),
                              daemon=True)
    try:
        sender.start()
        sender.join(10)
        assert not sender.is_alive(), "notify blocked on a listener that does not read"
        assert sent[0] and not all(sent), sent   # the first went out; past the queue's length, dropped
        listener.settimeout(5)
        assert listener.recv(4096) == b"STATUS=0"
    finally:
        listener.close()


def test_no_socket_no_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.notify("READY=1") is False
