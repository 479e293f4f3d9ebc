"""Shared pieces of the benchmark: paths, statistics, ports, and processes that always get stopped.

Only the standard library (and numpy where noted) so that both the product venv and the peers'
bench venv can import it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GiB = 1 << 30


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of a list of per-run figures."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll ``check`` until it is true; TimeoutError after ``timeout_s`` or if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with status {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not ready after {timeout_s:g} s")


def tcp_ready(port: int) -> Callable[[], bool]:
    def check() -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0
    return check


class Procs:
    """Processes started by the harness; ``stop_all`` (also on exit of the ``with``) ends each one.

    Every child runs in its own process group so that helpers it spawned go with it.
    """

    def __init__(self) -> None:
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: Sequence[str], log: Path | None = None, **kw: Any) -> subprocess.Popen:
        with open(log, "ab") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as out:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, **kw)
        self._procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``grace_s``."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        else:  # the leader is gone; make sure nothing of its group lingers
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._procs = [(n, p) for n, p in self._procs if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(list(self._procs)):
            self.stop(proc)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def start_sender(argv: Sequence[str]) -> tuple[subprocess.Popen[str], int]:
    """Start a helper process that prints the TCP port it listens on as its first line of stdout
    and runs until its stdin closes (see :func:`stop_sender`); (the process, the port)."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"sender {' '.join(argv[1:])} did not start")
    return proc, int(line)


def stop_sender(proc: subprocess.Popen[str]) -> None:
    """Close the helper's stdin (its signal to end) and wait for it; killed after 10 s."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def run_worker(argv: Sequence[str], out_json: Path, timeout_s: float, log: Path,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a worker process to completion (bounded by ``timeout_s``) and read the JSON it wrote.

    Raises RuntimeError with the tail of its log when it fails or writes nothing.
    """
    out_json.unlink(missing_ok=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO_ROOT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            raise RuntimeError(f"timed out after {timeout_s:g} s") from None
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            raise
        finally:
            # helpers the worker left behind in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    if out_json.exists():
        data = json.loads(out_json.read_text())
        if rc != 0 and "error" not in data:
            data["error"] = f"worker exited with status {rc}"
        return data
    raise RuntimeError(f"worker exited with status {rc} and no result; log tail: {tail(log)}")


def tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])[-600:]


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    tmp.replace(path)


@contextlib.contextmanager
def worker_output(path: str) -> Iterator[dict[str, Any]]:
    """In a worker: collect results in a dict, always written to ``path`` (with ``error`` on failure)."""
    result: dict[str, Any] = {}
    try:
        yield result
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
        write_json(path, result)
        raise
    write_json(path, result)


def python_env() -> dict[str, str]:
    """The environment for workers: the repo root importable, threads bounded on a small machine."""
    env = dict(os.environ)
    # This checkout's daemon and SDK, whatever the venv's install points at.
    paths = (str(REPO_ROOT), str(REPO_ROOT / "client"), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def this_python() -> str:
    return sys.executable
