"""Limits: raw streaming throughput between two processes over a Unix socket and loopback TCP.

The sender sends block-sized chunks cycling through its working set; the receiver ``recv_into``s
a working set of its own and acks each run with one byte; a run's time ends at the ack.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.common import python_env, summary, worker_output

SOCK_BUF = 4 << 20


def _tune(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    if s.family == socket.AF_INET:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def receiver(kind: str, addr: str, block: int, ws: int, per_run: int, runs: int) -> None:
    fam = socket.AF_UNIX if kind == "unix" else socket.AF_INET
    lsock = socket.socket(fam, socket.SOCK_STREAM)
    _tune(lsock)
    lsock.bind(addr if kind == "unix" else ("127.0.0.1", int(addr)))
    lsock.listen(1)
    lsock.settimeout(60)
    print("LISTENING", flush=True)
    conn, _ = lsock.accept()
    conn.settimeout(120)
    _tune(conn)
    buf = np.zeros(ws, dtype=np.uint8)
    view = buf.data
    pos = 0
    for _ in range(runs):
        left = per_run
        while left:
            n = min(block, left, ws - pos)
            got = conn.recv_into(view[pos: pos + n], n)
            if got == 0:
                raise ConnectionError("sender went away")
            pos = (pos + got) % ws
            left -= got
        conn.sendall(b"k")
    conn.close()
    lsock.close()


def measure(kind: str, block: int, ws: int, per_run: int, runs: int) -> list[float]:
    tmp = tempfile.mkdtemp(prefix="kvbench-stream-")
    if kind == "unix":
        addr = str(Path(tmp) / "s.sock")
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            addr = str(probe.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench.streams", "--role", "recv", "--kind", kind,
                             "--addr", addr, "--block", str(block), "--ws", str(ws), "--per-run", str(per_run),
                             "--runs", str(runs + 1)], stdout=subprocess.PIPE, env=python_env())
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"LISTENING":
            raise RuntimeError("receiver did not start")
        fam = socket.AF_UNIX if kind == "unix" else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        _tune(s)
        s.settimeout(120)
        s.connect(addr if kind == "unix" else ("127.0.0.1", int(addr)))
        src = np.full(ws, 7, dtype=np.uint8)
        view = src.data
        pos = 0
        out = []
        for run in range(runs + 1):  # run 0 warms up
            t0 = time.perf_counter()
            left = per_run
            while left:
                n = min(block, left, ws - pos)
                s.sendall(view[pos: pos + n])
                pos = (pos + n) % ws
                left -= n
            if s.recv(1) != b"k":
                raise ConnectionError("no ack")
            if run:
                out.append(per_run / (time.perf_counter() - t0) / 1e9)
        s.close()
        proc.wait(timeout=30)
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="send")
    p.add_argument("--kind", default="unix")
    p.add_argument("--addr", default="")
    p.add_argument("--block", type=int, default=2 << 20)
    p.add_argument("--sizes", default=f"{2 << 20},{256 << 10}")
    p.add_argument("--ws", type=int, default=1 << 30)
    p.add_argument("--per-run", type=int, default=1 << 30)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.role == "recv":
        receiver(a.kind, a.addr, a.block, a.ws, a.per_run, a.runs)
        return 0
    with worker_output(a.out) as result:
        rows = []
        for kind in ("unix", "tcp"):
            for block in (int(s) for s in a.sizes.split(",")):
                gbps = measure(kind, block, a.ws, a.per_run, a.runs)
                rows.append({"kind": kind, "block_bytes": block, "gbps": gbps, **summary(gbps)})
        result["results"] = rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
