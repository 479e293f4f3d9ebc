"""The raw TCP limit on loopback: what the peer-channel and cluster benchmarks hold kvstored's block
shipping against. No framing, no checksums: the ceiling.

A sender process (:func:`start`) holds ``blocks`` distinct blocks in memory, every page touched,
prints its port, and for each 8-byte count it reads ``sendall``s that many blocks back to back,
cycling over its blocks; it ends when the connection or its stdin closes. :class:`RawReceiver`
asks for a run and ``recv_into``s the blocks: block ``i`` into slot ``i % slots`` of a pre-touched
region, as a store lands blocks in arena slots (``slots=1``: one reused buffer).
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import subprocess
import sys
import time

from tools.bench.common import start_sender


def make_blocks(count: int, size: int) -> list[tuple[bytes, bytearray]]:
    """``count`` (32-byte key, block) pairs; block ``i`` is distinct, starts with ``i`` (8 bytes,
    big-endian) and has every page touched."""
    blocks = []
    for i in range(count):
        buf = bytearray(os.urandom(64) * (size // 64))
        buf[:8] = i.to_bytes(8, "big")
        blocks.append((i.to_bytes(4, "big") * 8, buf))
    return blocks


def serve(count: int, size: int) -> None:
    """The sender: print the port, then send what each request asks for, until the peer closes."""
    blocks = make_blocks(count, size)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                order = conn.recv(8)
                if len(order) != 8:
                    return
                n = int.from_bytes(order, "big")
                for i in range(n):
                    conn.sendall(memoryview(blocks[i % count][1]))


def start(blocks: int, block_bytes: int) -> tuple[subprocess.Popen[str], int]:
    """A sender process of ``blocks`` blocks of ``block_bytes``; (the process, its port). Stop it
    with :func:`tools.bench.common.stop_sender` once its receiver is closed."""
    return start_sender([sys.executable, "-m", "tools.bench.rawtcp", "--blocks", str(blocks),
                         "--block-bytes", str(block_bytes)])


class RawReceiver:
    """Receives the raw sender's stream: into one reused buffer (``slots`` 1), or block ``i`` into
    slot ``i % slots`` of a pre-touched region, as a store receives blocks into arena slots."""

    def __init__(self, port: int, size: int, slots: int = 1) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = mmap.mmap(-1, size * slots)
        for off in range(0, size * slots, mmap.PAGESIZE):   # touched before timing, as the arena is
            self.buf[off] = 0
        self.slots = slots

    def run(self, nblocks: int, size: int) -> float:
        """Ask for ``nblocks`` blocks of ``size`` bytes and receive them; bytes per second."""
        region = memoryview(self.buf)
        self.sock.sendall(nblocks.to_bytes(8, "big"))
        t0 = time.perf_counter()
        for i in range(nblocks):
            view = region[(i % self.slots) * size:(i % self.slots + 1) * size]
            got = 0
            while got < size:
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise RuntimeError("raw sender closed early")
                got += n
        return nblocks * size / (time.perf_counter() - t0)

    def close(self) -> None:
        self.sock.close()
        self.buf.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.rawtcp", description="the raw TCP sender (a helper)")
    p.add_argument("--blocks", type=int, required=True, help="distinct blocks the sender holds")
    p.add_argument("--block-bytes", type=int, required=True)
    a = p.parse_args(argv)
    serve(a.blocks, a.block_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
