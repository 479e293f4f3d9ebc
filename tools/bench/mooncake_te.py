"""Mooncake Transfer Engine over TCP on loopback, the peer stores' counterpart of the raw TCP limit
(:mod:`tools.bench.rawtcp`) in the peer-channel and cluster benchmarks: a target process holds the
blocks, an initiator process reads them, and :class:`MooncakeReceiver` (in the benchmark's
process) starts the pair and times its runs.

The two roles run under the ``.bench/venv`` python (``python -m tools.bench.mooncake_te ROLE``): at
their top, this module imports only the standard library and :mod:`tools.bench.common`, and
``mooncake.engine`` only in them, never kvstored. Each is a long-lived process driven over stdin /
stdout with one JSON object per line:

* ``target``: allocates ``--blocks`` distinct blocks of ``--block-bytes`` in one anonymous mmap (every
  page touched), starts a TransferEngine (protocol ``tcp``, ``P2PHANDSHAKE`` metadata: no etcd / http
  metadata server, the initiator fetches the segment descriptor from the target's RPC port), registers
  the whole region and prints ``{"session": "127.0.0.1:<rpc port>", "base": addr, "stride": block_bytes}``.
  It then sleeps until stdin closes (Mooncake's own threads serve the reads).
* ``initiator``: starts its own TransferEngine the same way, registers a destination region of
  ``--blocks`` block slots, prints ``{"ready": true}``, then for each input line ``{"nblocks": n, "mode": m}``
  moves n blocks (cycling over the target's distinct blocks, block i into slot i) and prints
  ``{"seconds": t}`` (the transfers only) or ``{"error": why}``. Modes: ``batch`` = one
  ``batch_transfer_sync_read`` per ``--blocks`` blocks (as kvstored fetches ``--blocks`` keys per call);
  ``sync`` = one ``transfer_sync_read`` per block.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from tools.bench.common import REPO_ROOT, stop_sender

LOG = REPO_ROOT / ".bench" / "mooncake-te.log"   # the roles' stderr, when .bench/ exists


# -- the driver (the benchmark's process) --------------------------------------------------------------
class MooncakeError(RuntimeError):
    """The Mooncake pair could not start or a run failed; the message says why (for the table)."""


def read_reply(proc: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    """One JSON line from a role (each request gets exactly one line back)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise MooncakeError(f"{what}: no reply within {timeout:g} s")
    line = proc.stdout.readline()
    if not line:
        raise MooncakeError(f"{what}: helper exited (status {proc.poll()}); see {LOG}")
    try:
        reply: dict[str, Any] = json.loads(line)
    except ValueError:
        raise MooncakeError(f"{what}: unexpected output {line.strip()[:200]!r}") from None
    if "error" in reply:
        raise MooncakeError(f"{what}: {reply['error']}")
    return reply


class MooncakeReceiver:
    """A target (holds ``blocks`` blocks of ``block_bytes``) and initiator (reads them) pair, both
    under ``python``, the bench venv's."""

    def __init__(self, python: str, blocks: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.procs: list[subprocess.Popen[str]] = []
        if not Path(python).exists():
            raise MooncakeError(f"no {python} (the peers' venv; tools/bench/peerenv.py makes it)")
        self.log: IO[bytes] | int = open(LOG, "ab") if LOG.parent.is_dir() else subprocess.DEVNULL
        role = [python, "-m", "tools.bench.mooncake_te"]
        sizes = ["--blocks", str(blocks), "--block-bytes", str(block_bytes)]
        try:
            target = self._start([*role, "target", *sizes])
            info = read_reply(target, 120, "Mooncake target start")
            self.initiator = self._start([*role, "initiator", *sizes, "--session", str(info["session"]),
                                          "--remote-base", str(info["base"]), "--remote-stride", str(info["stride"])])
            read_reply(self.initiator, 120, "Mooncake initiator start")
        except BaseException:
            self.close()
            raise

    def _start(self, argv: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                cwd=REPO_ROOT)
        self.procs.append(proc)
        return proc

    def run(self, nblocks: int, mode: str) -> float:
        """Read ``nblocks`` blocks in ``mode`` (``batch`` or ``sync``); bytes per second."""
        assert self.initiator.stdin is not None
        try:
            self.initiator.stdin.write(json.dumps({"nblocks": nblocks, "mode": mode}) + "\n")
            self.initiator.stdin.flush()
        except OSError as exc:
            raise MooncakeError(f"Mooncake initiator gone: {exc}") from None
        reply = read_reply(self.initiator, 300, f"Mooncake {mode} run")
        return nblocks * self.block_bytes / float(reply["seconds"])

    def close(self) -> None:
        for proc in reversed(self.procs):   # initiator first
            stop_sender(proc)
        self.procs.clear()
        if not isinstance(self.log, int):
            self.log.close()
            self.log = subprocess.DEVNULL


# -- the roles (the bench venv's processes) ------------------------------------------------------------


def _region(nbytes: int) -> tuple[mmap.mmap, int]:
    region = mmap.mmap(-1, nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    return region, addr


def _engine(hostname: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(tcp, P2PHANDSHAKE) returned {rc}")
    return engine


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def target(args: argparse.Namespace) -> None:
    count, size = args.blocks, args.block_bytes
    region, base = _region(count * size)
    seed = bytes(range(64))
    for i in range(count):   # distinct per block, every page touched (like rawtcp.make_blocks)
        block = bytearray(seed * (size // 64))
        block[:8] = i.to_bytes(8, "big")
        region[i * size:(i + 1) * size] = block
    engine = _engine(args.host)
    rc = engine.register_memory(base, count * size)
    if rc != 0:
        raise RuntimeError(f"register_memory returned {rc}")
    _say({"session": f"{args.host}:{engine.get_rpc_port()}", "base": base, "stride": size})
    sys.stdin.read()   # until the parent closes it
    engine.unregister_memory(base)


def initiator(args: argparse.Namespace) -> None:
    count, size = args.blocks, args.block_bytes
    region, base = _region(count * size)
    for off in range(0, count * size, mmap.PAGESIZE):   # touch the destination before timing
        region[off] = 0
    engine = _engine(args.host)
    rc = engine.register_memory(base, count * size)
    if rc != 0:
        raise RuntimeError(f"register_memory returned {rc}")
    session, remote, stride = args.session, args.remote_base, args.remote_stride
    _say({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        order = json.loads(line)
        nblocks, mode = int(order["nblocks"]), order["mode"]
        try:
            t0 = time.perf_counter()
            done = 0
            while done < nblocks:
                n = min(count, nblocks - done)
                if mode == "batch":
                    rc = engine.batch_transfer_sync_read(
                        session, [base + i * size for i in range(n)],
                        [remote + i * stride for i in range(n)], [size] * n)
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
                else:
                    for i in range(n):
                        rc = engine.transfer_sync_read(session, base + i * size, remote + i * stride, size)
                        if rc != 0:
                            raise RuntimeError(f"transfer_sync_read returned {rc}")
                done += n
            seconds = time.perf_counter() - t0
        except Exception as exc:
            _say({"error": str(exc)[:300]})
            continue
        # spot check: slot 0 holds block 0 (its first 8 bytes are its index)
        if int.from_bytes(region[:8], "big") != 0 or (count > 1 and nblocks > 1
                                                     and int.from_bytes(region[size:size + 8], "big") != 1):
            _say({"error": "destination does not hold the expected blocks"})
            continue
        _say({"seconds": seconds})
    engine.unregister_memory(base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.mooncake_te",
                                     description="Mooncake Transfer Engine roles (helpers, under .bench/venv)")
    parser.add_argument("role", choices=["target", "initiator"])
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--session", help="initiator: the target's 'host:rpc_port'")
    parser.add_argument("--remote-base", type=int, help="initiator: address of the target's first block")
    parser.add_argument("--remote-stride", type=int, help="initiator: bytes between the target's blocks")
    args = parser.parse_args(argv)
    # JSON replies get their own copy of stdout; fd 1 goes to stderr so nothing Mooncake's C++ side prints
    # can mix into them.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(reply_fd, "w", buffering=1)
    try:
        if args.role == "target":
            target(args)
        else:
            initiator(args)
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"[:300]})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
