"""A loopback TCP relay that paces what the server sends back to a given rate: a slow peer link
between two daemons on one machine, for the benchmarks that need one (``vllm-decode``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

# What the relay reads at once: the pacing's grain (a 256 KiB block crosses in 16 steps).
CHUNK = 16 << 10


class PacedLink:
    """Listens on ``127.0.0.1:<port>`` and relays to ``target``; server-to-client bytes at most
    ``bytes_per_s`` (0: unpaced). ``bytes_per_s`` may be changed while it runs."""

    def __init__(self, target: tuple[str, int], bytes_per_s: float = 0.0) -> None:
        self.target = target
        self.bytes_per_s = bytes_per_s
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target)
            except OSError:
                if self._closed.is_set():
                    return
                continue
            # a small receive buffer keeps the sender waiting on the link, not done early
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(CHUNK):
                if paced and self.bytes_per_s:
                    time.sleep(len(data) / self.bytes_per_s)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
