"""A kvstored daemon in a subprocess for the benchmarks that drive one through a client (ssd, model,
gpu): started on a socket in a temp directory, connected to, and stopped (SIGTERM) when the block
ends, its directory removed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kvstored
from tools.bench.common import REPO_ROOT


@contextmanager
def local_daemon(*args: str, timeout_s: float = 60.0, ssd_path: Path | None = None) -> Iterator[kvstored.Client]:
    """Start ``kvstored --socket <tmp> *args`` and yield a connected client; its SSD tier lives in
    ``ssd_path`` (default: ``ssd`` in the temp directory)."""
    tmp = tempfile.mkdtemp(prefix="kvstored-bench-")
    sock = str(Path(tmp) / "kv.sock")
    daemon = subprocess.Popen([sys.executable, "-m", "kvstored", "--no-config", "--socket", sock, "--ssd-path",
                               str(ssd_path or Path(tmp) / "ssd"), *args], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client = kvstored.Client(sock)
                break
            except kvstored.DaemonNotRunning:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise
                time.sleep(0.2)
        try:
            yield client
        finally:
            client.close()
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
