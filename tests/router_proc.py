"""A kvstored-router process for tests, and daemons that publish KV events on ipc:// sockets."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loopback import free_ports


def events_args(tmp: Path, node: str, *extra: str) -> list[str]:
    """Flags for start_daemon: events on ipc sockets under ``tmp`` named after ``node``."""
    return ["--set", "events.enabled=true", "--set", f"events.endpoint=ipc://{tmp}/{node}.pub",
            "--set", f"events.replay_endpoint=ipc://{tmp}/{node}.replay", "--set", "events.heartbeat_s=0.2",
            "--set", f"events.node_id={node}", *extra]


def source(tmp: Path, node: str) -> str:
    return f"{node}=ipc://{tmp}/{node}.pub,ipc://{tmp}/{node}.replay"


class RouterProc:
    def __init__(self, tmp: Path, sources: list[str], *extra: str) -> None:
        self.port = free_ports(1)[0]
        self.log_path = tmp / f"router-{self.port}.log"
        args = [sys.executable, "-m", "kvstored.router.main", "--no-config", "--listen", f"127.0.0.1:{self.port}",
                "--set", "router.heartbeat_timeout_s=1.0", "--set", "log.level=debug", *extra]
        for s in sources:
            args += ["--source", s]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {self.log()}")
            try:
                self.get("/healthz")
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"router did not serve: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    def post(self, path: str, obj: Any) -> tuple[int, Any]:
        return self.request("POST", path, json.dumps(obj).encode())

    def get(self, path: str) -> Any:
        return self.request("GET", path)[1]

    def wait(self, predicate: Any, timeout: float = 15.0) -> Any:
        """Poll /v1/nodes until ``predicate(nodes)`` holds; returns the last answer."""
        deadline = time.monotonic() + timeout
        while True:
            nodes = self.get("/v1/nodes")
            if predicate(nodes):
                return nodes
            if time.monotonic() > deadline:
                raise AssertionError(f"router state never matched: {nodes}\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode
