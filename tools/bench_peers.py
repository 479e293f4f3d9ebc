"""Micro-benchmark: the peer block channel against a raw TCP stream of the same bytes, same run.

One sender process and one receiver (this process) on loopback. The sender holds ``--blocks``
distinct blocks of ``--block-bytes`` (default 2 MiB) in memory, touched before timing. Each run moves
``--run-bytes``:

* raw TCP: the sender ``sendall``s the blocks back to back on a blocking socket; the receiver
  ``recv_into``s a reused buffer. No framing, no checksums: the ceiling.
* kvstored peers: ``PeerConnection.fetch`` of the block keys over one connection (framing, xxh3
  on both sides, ordered per-block delivery), under uvloop (as the daemon runs) and plain asyncio.

Runs alternate between the paths so machine noise hits them alike; the table gives medians over
``--runs`` runs (at least 5) and each path's ratio to raw TCP's median. Target: >= 0.7x raw.

    .venv/bin/python tools/bench_peers.py [--runs 7] [--run-bytes 512MiB]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstored.peers.transport import BlockServer, PeerAuth, PeerConnection

NAMESPACE = 7


def make_blocks(count: int, size: int) -> list[tuple[bytes, bytearray]]:
    blocks = []
    for i in range(count):
        buf = bytearray(os.urandom(64) * (size // 64))   # distinct per block, every page touched
        buf[:8] = i.to_bytes(8, "big")
        blocks.append((i.to_bytes(4, "big") * 8, buf))
    return blocks


# -- sender roles (run in a child process) ---------------------------------------------------------
def serve_raw(count: int, size: int) -> None:
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


def serve_transport(count: int, size: int, use_uvloop: bool) -> None:
    blocks = {key: memoryview(buf) for key, buf in make_blocks(count, size)}

    async def serve_block(namespace_id: int, key: bytes) -> memoryview | None:
        return blocks.get(key)

    async def main() -> None:
        server = BlockServer("127.0.0.1", 0, PeerAuth(), serve_block)
        await server.start()
        print(server.address[1], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # until the parent closes it
        await server.close()

    run(main(), use_uvloop)


def run(coro: object, use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop
        uvloop.run(coro)  # type: ignore[arg-type]
    else:
        asyncio.run(coro)  # type: ignore[arg-type]


def start_sender(role: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, __file__, "--role", role, "--blocks", str(args.blocks),
                             "--block-bytes", str(args.block_bytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"sender {role} did not start")
    return proc, int(line)


def stop_sender(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# -- receivers (this process) -----------------------------------------------------------------------
class RawReceiver:
    def __init__(self, port: int, size: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = bytearray(size)

    def run(self, nblocks: int, size: int) -> float:
        view = memoryview(self.buf)
        self.sock.sendall(nblocks.to_bytes(8, "big"))
        total = nblocks * size
        t0 = time.perf_counter()
        got = 0
        while got < total:
            n = self.sock.recv_into(view[: min(size, total - got)])
            if n == 0:
                raise RuntimeError("raw sender closed early")
            got += n
        return total / (time.perf_counter() - t0)

    def close(self) -> None:
        self.sock.close()


def transport_runs(port: int, args: argparse.Namespace, nblocks: int, runs: int, use_uvloop: bool,
                   between: Callable[[], None]) -> list[float]:
    keys = [i.to_bytes(4, "big") * 8 for i in range(args.blocks)]
    rates: list[float] = []

    async def main() -> None:
        conn = await PeerConnection.open(("127.0.0.1", port), PeerAuth())
        try:
            for _ in range(runs):
                between()
                left = nblocks
                t0 = time.perf_counter()
                while left:
                    chunk = keys[: min(left, len(keys))]
                    result = await conn.fetch(NAMESPACE, chunk, lambda i, p: None, 60.0)
                    if not result.complete:
                        raise RuntimeError(f"fetch stopped: {result}")
                    left -= len(chunk)
                rates.append(nblocks * args.block_bytes / (time.perf_counter() - t0))
        finally:
            conn.close()

    run(main(), use_uvloop)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--role", choices=["raw", "transport-uvloop", "transport-asyncio"], help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=32, help="distinct blocks the sender holds")
    parser.add_argument("--block-bytes", type=int, default=2 << 20)
    parser.add_argument("--run-bytes", type=int, default=512 << 20, help="bytes moved per run")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    if args.role == "raw":
        serve_raw(args.blocks, args.block_bytes)
        return 0
    if args.role is not None:
        serve_transport(args.blocks, args.block_bytes, args.role == "transport-uvloop")
        return 0
    if args.runs < 5:
        parser.error("--runs must be at least 5 (medians)")

    nblocks = max(1, args.run_bytes // args.block_bytes)
    raw_proc, raw_port = start_sender("raw", args)
    raw = RawReceiver(raw_port, args.block_bytes)
    raw_rates: list[float] = []
    results: dict[str, list[float]] = {}
    try:
        raw.run(nblocks, args.block_bytes)   # warm-up
        for name, role, use_uv in (("kvstored peers (uvloop)", "transport-uvloop", True),
                                   ("kvstored peers (asyncio)", "transport-asyncio", False)):
            proc, port = start_sender(role, args)
            try:
                transport_runs(port, args, nblocks, 1, use_uv, lambda: None)   # warm-up
                # alternate: one raw run before each transport run
                results[name] = transport_runs(
                    port, args, nblocks, args.runs, use_uv,
                    lambda: raw_rates.append(raw.run(nblocks, args.block_bytes)))
            finally:
                stop_sender(proc)
    finally:
        raw.close()
        stop_sender(raw_proc)

    raw_median = statistics.median(raw_rates)
    mib = args.block_bytes / (1 << 20)
    print(f"\nPeer block channel vs raw TCP, loopback, {mib:g} MiB blocks, {nblocks} blocks "
          f"({nblocks * args.block_bytes >> 20} MiB) per run, {args.runs} runs per path, "
          f"{os.cpu_count()} CPUs\n")
    print("| path | median GB/s | min GB/s | max GB/s | vs raw TCP |")
    print("|---|---|---|---|---|")
    rows = [("raw TCP (blocking sendall / recv_into)", raw_rates), *results.items()]
    for name, rates in rows:
        med = statistics.median(rates)
        print(f"| {name} | {med / 1e9:.2f} | {min(rates) / 1e9:.2f} | {max(rates) / 1e9:.2f} | "
              f"{med / raw_median:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
