"""Repository checks: generated code in sync, lint and types, systemd unit, SDK stays light."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_generated_proto_code_matches_protos() -> None:
    out = run(sys.executable, "tools/gen_proto.py", "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff() -> None:
    out = run(str(BIN / "ruff"), "check", "kvstored", "client", "tools", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy() -> None:
    out = run(str(BIN / "mypy"), "--no-incremental", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sdk_import_loads_no_daemon_dependencies() -> None:
    code = ("import sys, kvstored, kvstored_client; "
            "bad = [m for m in ('uvloop', 'lmdb', 'kvstored.server', 'kvstored.store', 'torch') "
            "if m in sys.modules]; print(bad)")
    out = run(sys.executable, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "kvstored.service").read_text()
    assert "Type=notify" in unit and "LimitMEMLOCK=infinity" in unit and "PrivateDevices=yes" not in unit
    # verify checks that ExecStart exists: point it at this environment's entry point
    (tmp_path / "kvstored.service").write_text(unit.replace("/usr/bin/kvstored", str(BIN / "kvstored")))
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "warning"}
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kvstored.service")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kvstored.service" not in out.stderr, out.stderr  # no warnings about our unit
