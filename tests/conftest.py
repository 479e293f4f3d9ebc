"""Shared fixtures: real daemons in subprocesses on sockets in a per-test temp directory."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loopback import free_ports

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Daemon:
    """A kvstored process started for a test."""

    socket: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def wait_serving(socket: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Poll the gRPC health service until SERVING; fail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvstored exited with {proc.returncode} before serving")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError("kvstored did not become SERVING in time")


def start_daemon(tmp: Path, *extra: str, env: dict[str, str] | None = None, wait: bool = True,
                 name: str = "kv") -> Daemon:
    tmp.mkdir(parents=True, exist_ok=True)
    socket = str(tmp / f"{name}.sock")
    log_path = tmp / f"{name}.log"
    config = [] if "--config" in extra else ["--no-config"]   # embedded defaults, whatever /etc holds
    args = [sys.executable, "-m", "kvstored", *config, "--socket", socket, "--dram-capacity", "64MiB",
            "--set", "dram.page_bytes=1MiB", "--set", "log.level=debug",
            "--ssd-path", str(tmp / f"{name}-ssd"), "--ssd-capacity", "256MiB", *extra]
    full_env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "KVSTORED_SOCKET")}
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    daemon = Daemon(socket, proc, log_path, args)
    if wait:
        try:
            wait_serving(socket, proc)
        except BaseException:
            daemon.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon failed to start:\n{daemon.log()}") from None
    return daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[object]:
    started: list[Daemon] = []

    def factory(*extra: str, **kwargs: object) -> Daemon:
        d = start_daemon(tmp_path / f"d{len(started)}", *extra, **kwargs)  # type: ignore[arg-type]
        started.append(d)
        return d

    yield factory
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory) -> Daemon:  # type: ignore[no-untyped-def]
    return daemon_factory()  # type: ignore[no-any-return]


@pytest.fixture(params=["frames", "grpc"])
def client(daemon: Daemon, request: pytest.FixtureRequest) -> Iterator[object]:
    """A client of ``daemon``, once with its hot calls on the fast path (frames on the daemon's
    second socket), once all on gRPC: every test using it checks both transports."""
    import kvstored

    c = kvstored.Client(daemon.socket, fast_path=request.param == "frames")
    assert c.transport == request.param
    yield c
    c.close()


# -- etcd, for membership tests ------------------------------------------------------------------
def etcd_binary() -> str | None:
    return shutil.which("etcd") or (str(Path("/usr/bin/etcd")) if Path("/usr/bin/etcd").exists() else None)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    """A fresh single-node etcd; yields its client endpoint ``127.0.0.1:port``."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd binary not found (install Debian's etcd-server: tools/ci/install-etcd.sh)")
    for _attempt in range(3):   # a random port may be taken between choosing and binding it
        client, peer = free_ports(2)
        log = tmp_path / f"etcd-{client}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [binary, "--name", "default", "--data-dir", str(tmp_path / f"data-{client}"),
                 "--listen-client-urls", f"http://127.0.0.1:{client}",
                 "--advertise-client-urls", f"http://127.0.0.1:{client}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                 "--listen-metrics-urls", "",
                 "--log-level", "warn"],
                stdout=out, stderr=subprocess.STDOUT)
        try:
            if _wait_healthy(client, proc, timeout=20):
                yield f"127.0.0.1:{client}"
                return
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
    pytest.fail(f"etcd did not start; last log:\n{log.read_text(errors='replace')[-2000:]}")


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                if resp.status == 200 and b"true" in resp.read():
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False
