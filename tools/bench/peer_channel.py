"""Micro-benchmark: the peer block channel against a raw TCP stream of the same bytes, same run.

One sender process and one receiver (this process) on loopback. The sender holds ``--blocks``
distinct blocks of ``--block-bytes`` (default 2 MiB) in memory, touched before timing. Each run moves
``--run-bytes``:

* raw TCP: the sender ``sendall``s the blocks back to back on a blocking socket; the receiver
  ``recv_into``s a reused buffer. No framing, no checksums: the ceiling.
* kvstored peers: ``PeerConnection.fetch`` of the block keys over one connection (framing, xxh3
  on both sides, ordered per-block delivery), under uvloop (as the daemon runs) and plain asyncio,
  and under uvloop with mutual TLS (what a listener on a non-loopback address needs; fresh
  certificates from :mod:`tools.pki`; left out, saying why, without the ``cryptography`` package).
* Mooncake Transfer Engine, protocol ``tcp`` (PyPI ``mooncake-transfer-engine-non-cuda``, run under
  ``.bench/venv``'s python by :mod:`tools.bench.mooncake_te`): a target process registers one
  region holding the blocks, an initiator process registers a destination region of ``--blocks`` slots
  and reads the blocks into it, P2P handshake (no metadata server). Two modes: ``batch_transfer_sync_read``
  of ``--blocks`` blocks per call (as kvstored fetches ``--blocks`` keys per call), and one
  ``transfer_sync_read`` per block. The initiator times its reads and reports them on stdout.
  ``--no-mooncake`` leaves it out; when it cannot run, its rows say why and the rest still runs.

Runs alternate between the paths so machine noise hits them alike (before each kvstored run: one raw
run, then one run of each Mooncake mode); the table gives medians over the runs (``--runs``, at least
5, per kvstored path; raw TCP and Mooncake get one run per kvstored run) and each path's ratio to raw
TCP's median. Targets: kvstored >= 0.7x raw and >= 1.5x Mooncake.

    .venv/bin/python -m tools.bench peers [--runs 7] [--run-bytes 512MiB] [--no-mooncake]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvstored.config import parse_size
from kvstored.peers.auth import PeerAuth, TLSFiles
from kvstored.peers.connection import PeerConnection
from kvstored.peers.server import BlockServer
from tools import pki
from tools.bench import peerenv, rawtcp
from tools.bench.common import start_sender, stop_sender
from tools.bench.mooncake_te import MooncakeError, MooncakeReceiver

NAMESPACE = 7
MOONCAKE_MODES = {  # mode -> table row
    "batch": "Mooncake TE tcp (batch_transfer_sync_read)",
    "sync": "Mooncake TE tcp (transfer_sync_read per block)",
}


# -- the kvstored sender (a child process: python -m tools.bench.peer_channel --role ...) --------------
def tls_auth(tls_dir: str, end: str) -> PeerAuth:
    """The mutual-TLS credentials :func:`tools.pki.mutual` wrote to ``tls_dir``, for ``end``."""
    d = Path(tls_dir)
    return PeerAuth(tls=TLSFiles(str(d / "ca.pem"), str(d / f"{end}.pem"), str(d / f"{end}.key")))


def serve_transport(count: int, size: int, use_uvloop: bool, auth: PeerAuth) -> None:
    blocks = {key: memoryview(buf) for key, buf in rawtcp.make_blocks(count, size)}

    async def serve_block(namespace_id: int, key: bytes) -> memoryview | None:
        return blocks.get(key)

    async def main() -> None:
        server = BlockServer("127.0.0.1", 0, auth, serve_block)
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


def start_transport(role: str, args: argparse.Namespace, tls_dir: str) -> tuple[subprocess.Popen[str], int]:
    """A sender of ``args.blocks`` blocks through kvstored's BlockServer under ``role``'s loop."""
    return start_sender([sys.executable, "-m", "tools.bench.peer_channel", "--role", role,
                         "--blocks", str(args.blocks), "--block-bytes", str(args.block_bytes), "--tls-dir", tls_dir])


# -- the receiver (this process) ------------------------------------------------------------------------
def transport_runs(port: int, args: argparse.Namespace, nblocks: int, runs: int, use_uvloop: bool,
                   between: Callable[[], None], auth: PeerAuth | None = None) -> list[float]:
    keys = [i.to_bytes(4, "big") * 8 for i in range(args.blocks)]
    rates: list[float] = []

    async def main() -> None:
        conn = await PeerConnection.open(("127.0.0.1", port), auth or PeerAuth())
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
    parser = argparse.ArgumentParser(prog="python -m tools.bench peers",
                                     description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--role", choices=["transport-uvloop", "transport-asyncio"], help=argparse.SUPPRESS)
    parser.add_argument("--tls-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=32, help="distinct blocks the sender holds")
    # sizes as the daemon's config takes them (512MiB), as the usage line above writes them
    parser.add_argument("--block-bytes", type=parse_size, default=2 << 20)
    parser.add_argument("--run-bytes", type=parse_size, default=512 << 20, help="bytes moved per run")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-mooncake", action="store_true", help="leave Mooncake's Transfer Engine out")
    parser.add_argument("--mooncake-python", default=str(peerenv.PY),
                        help="interpreter with mooncake installed (default: .bench/venv)")
    args = parser.parse_args(argv)
    if args.role is not None:
        serve_transport(args.blocks, args.block_bytes, args.role == "transport-uvloop",
                        tls_auth(args.tls_dir, "server") if args.tls_dir else PeerAuth())
        return 0
    if args.runs < 5:
        parser.error("--runs must be at least 5 (medians)")

    nblocks = max(1, args.run_bytes // args.block_bytes)
    raw_proc, raw_port = rawtcp.start(args.blocks, args.block_bytes)
    raw = rawtcp.RawReceiver(raw_port, args.block_bytes)
    raw_rates: list[float] = []
    results: dict[str, list[float]] = {}
    mc_rates: dict[str, list[float]] = {mode: [] for mode in MOONCAKE_MODES}
    mc_failed: dict[str, str] = {}   # mode -> why it has no figures
    mooncake: MooncakeReceiver | None = None
    if args.no_mooncake:
        mc_failed = dict.fromkeys(MOONCAKE_MODES, "left out (--no-mooncake)")
    else:
        try:
            mooncake = MooncakeReceiver(args.mooncake_python, args.blocks, args.block_bytes)
        except MooncakeError as exc:
            mc_failed = dict.fromkeys(MOONCAKE_MODES, str(exc))

    def mooncake_runs(record: bool) -> None:
        for mode in MOONCAKE_MODES:
            if mooncake is None or mode in mc_failed:
                continue
            try:
                rate = mooncake.run(nblocks, mode)
            except MooncakeError as exc:
                mc_failed[mode] = str(exc)
                continue
            if record:
                mc_rates[mode].append(rate)

    def between() -> None:
        raw_rates.append(raw.run(nblocks, args.block_bytes))
        mooncake_runs(True)

    tls_dir = tempfile.TemporaryDirectory(prefix="kvstored-bench-tls-")
    paths = [("kvstored peers (uvloop)", "transport-uvloop", True, ""),
             ("kvstored peers (asyncio)", "transport-asyncio", False, "")]
    left_out: dict[str, str] = {}
    tls_name = "kvstored peers (uvloop, mutual TLS)"
    if pki.available:
        pki.mutual(Path(tls_dir.name))
        paths.append((tls_name, "transport-uvloop", True, tls_dir.name))
    else:
        left_out[tls_name] = "the cryptography package (to make certificates) is not installed"
    try:
        raw.run(nblocks, args.block_bytes)   # warm-up
        mooncake_runs(False)                 # warm-up (connections, first touch of the destination)
        for name, role, use_uv, tls in paths:
            proc, port = start_transport(role, args, tls)
            auth = tls_auth(tls, "client") if tls else None
            try:
                transport_runs(port, args, nblocks, 1, use_uv, lambda: None, auth)   # warm-up
                # alternate: one raw run and one run of each Mooncake mode before each transport run
                results[name] = transport_runs(port, args, nblocks, args.runs, use_uv, between, auth)
            finally:
                stop_sender(proc)
    finally:
        tls_dir.cleanup()
        raw.close()
        stop_sender(raw_proc)
        if mooncake is not None:
            mooncake.close()

    raw_median = statistics.median(raw_rates)
    mib = args.block_bytes / (1 << 20)
    print(f"\nPeer block channel vs raw TCP vs Mooncake TE (tcp), loopback, {mib:g} MiB blocks, {nblocks} blocks "
          f"({nblocks * args.block_bytes >> 20} MiB) per run, {args.runs} runs per kvstored path, "
          f"{os.cpu_count()} CPUs\n")
    print("| path | runs | median GB/s | min GB/s | max GB/s | vs raw TCP |")
    print("|---|---|---|---|---|---|")
    rows: list[tuple[str, list[float], str | None]] = [
        ("raw TCP (blocking sendall / recv_into)", raw_rates, None),
        *((name, rates, None) for name, rates in results.items()),
        *((name, [], why) for name, why in left_out.items()),
        *((MOONCAKE_MODES[mode], mc_rates[mode], mc_failed.get(mode)) for mode in MOONCAKE_MODES)]
    for name, rates, failed in rows:
        if failed is not None or not rates:
            why = (failed or "no runs").replace("|", "/")
            print(f"| {name} | {len(rates)} | - | - | - | not measured: {why} |")
            continue
        med = statistics.median(rates)
        print(f"| {name} | {len(rates)} | {med / 1e9:.2f} | {min(rates) / 1e9:.2f} | {max(rates) / 1e9:.2f} | "
              f"{med / raw_median:.2f}x |")
    measured = {mode: statistics.median(rates) for mode, rates in mc_rates.items()
                if rates and mode not in mc_failed}
    print()
    if not measured:
        print("kvstored / Mooncake: n/a (Mooncake not measured)")
    else:
        best = max(measured, key=lambda mode: measured[mode])   # the stronger Mooncake mode is the bar
        for name, rates in results.items():
            print(f"kvstored / Mooncake: {name} / {MOONCAKE_MODES[best]} = "
                  f"{statistics.median(rates) / measured[best]:.2f}x (medians; target >= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
