"""The benchmarks' paced relay (``tools.bench.paced_link``): what goes through it arrives whole and
in order both ways, paced or not."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

from tools.bench.paced_link import PacedLink


def echo_server() -> tuple[socket.socket, int]:
    """A server that sends back what it receives, on a free loopback port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    while data := conn.recv(1 << 16):
                        conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return listener, int(listener.getsockname()[1])


def through(link: PacedLink, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", link.port)) as conn:
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload) and (data := conn.recv(1 << 16)):
            got += data
        sender.join()
    return bytes(got)


def test_bytes_cross_whole_and_in_order_paced_or_not() -> None:
    listener, port = echo_server()
    link = PacedLink(("127.0.0.1", port), bytes_per_s=64 << 20)
    try:
        payload = os.urandom(3 << 20)
        assert through(link, payload) == payload
        link.bytes_per_s = 0.0     # unpaced, changed while it runs
        assert through(link, payload) == payload
    finally:
        link.close()
        listener.close()

