"""A loopback TCP proxy for fault tests between real daemons: it forwards both ways, can throttle
the server-to-client direction (so a transfer is still in flight when the test strikes), and can
stall (a partition: connections stay open, nothing moves) or cut every connection."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class FaultProxy:
    """Listens on ``127.0.0.1:<port>`` (picked here) and forwards to ``target``."""

    def __init__(self, target: tuple[str, int], rate_bytes_s: float = 0.0, chunk: int = 16 << 10) -> None:
        self.target = target
        self.rate = rate_bytes_s
        self.chunk = chunk
        self.stalled = threading.Event()
        self.closed = threading.Event()
        self.forwarded = 0     # server -> client bytes
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.socket()
                # a small receive buffer keeps the sender blocked instead of done early
                server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
                server.connect(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while not self.closed.is_set():
                data = src.recv(self.chunk)
                if not data:
                    break
                while self.stalled.is_set() and not self.closed.is_set():
                    time.sleep(0.01)
                if downstream and self.rate:
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
                if downstream:
                    self.forwarded += len(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        """Reset every connection now."""
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    s.close()
            self._socks.clear()

    def close(self) -> None:
        self.closed.set()
        self._listener.close()
        self.cut()
