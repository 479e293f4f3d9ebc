"""The peers' own environment: ``.bench/venv`` (git-ignored), separate from the product's.

It is created without system site-packages; torch==2.13.0 (the CPU wheel) goes in first and stays
pinned by a constraints file for every later install, so nothing can pull a CUDA build.
``redis-server`` and Mooncake's system libraries come from Debian packages when missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools.bench.common import REPO_ROOT

BENCH_DIR = REPO_ROOT / ".bench"
VENV = BENCH_DIR / "venv"
PY = VENV / "bin" / "python"
TORCH = "torch==2.13.0"
STEPS = {  # peer -> pip requirements (installed in this order)
    "base": ["numpy", "redis", "hiredis", "matplotlib", "grpcio"],
    "mooncake": ["mooncake-transfer-engine-non-cuda"],
    "lmcache": ["lmcache"],
}
MOONCAKE_LIBS = ["libibverbs1", "librdmacm1", "libnuma1", "liburing2", "libcurl4"]
CHECKS = {
    "redis": "import redis, hiredis",
    "mooncake": "from mooncake.store import MooncakeDistributedStore",
    "lmcache": "import torch, lmcache.v1.cache_engine; assert torch.__version__.endswith('+cpu'), torch.__version__",
    "matplotlib": "import matplotlib",
}


def _run(argv: list[str], log: Path, timeout: float) -> tuple[bool, str]:
    with open(log, "ab") as fh:
        fh.write(f"\n$ {' '.join(argv)}\n".encode())
        fh.flush()
        try:
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=timeout, cwd=REPO_ROOT).returncode
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:g} s"
        except OSError as exc:
            return False, str(exc)
    return rc == 0, f"exit status {rc}"


def check(name: str, log: Path) -> str | None:
    """None when ``name`` imports in the bench venv, else the reason it does not."""
    if not PY.exists():
        return "bench venv .bench/venv does not exist (run without --quick to create it)"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), LMCACHE_LOG_LEVEL="ERROR", LMCACHE_TRACK_USAGE="false")
    try:
        p = subprocess.run([str(PY), "-c", CHECKS[name]], capture_output=True, text=True, timeout=180,
                           cwd=REPO_ROOT, env=env)
    except subprocess.TimeoutExpired:
        return "import timed out"
    if p.returncode == 0:
        return None
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    reason = lines[-1] if lines else f"exit status {p.returncode}"
    with open(log, "a") as fh:
        fh.write(f"check {name}: {p.stderr[-2000:]}\n")
    return f"import fails: {reason}"[:300]


def _apt(packages: list[str], log: Path) -> tuple[bool, str]:
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return False, "apt-get not available as root"
    ok, why = _run(["apt-get", "update", "-qq"], log, 600)
    if not ok:
        return False, f"apt-get update: {why}"
    return _run(["apt-get", "install", "-y", "-qq", *packages], log, 900)


def ensure(peers: list[str], install: bool, log: Path) -> dict[str, str | None]:
    """Make what ``peers`` need available (if ``install``); returns peer -> None or why it can't run."""
    BENCH_DIR.mkdir(exist_ok=True)
    reasons: dict[str, str | None] = {}
    if install and not PY.exists():
        ok, why = _run([sys.executable, "-m", "venv", str(VENV)], log, 300)
        if not ok:
            return {p: f"cannot create .bench/venv: {why}" for p in peers}
    constraints = BENCH_DIR / "constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    pip = [str(PY), "-m", "pip", "install", "-q", "-c", str(constraints)]
    wanted = ["base"] + [p for p in peers if p in STEPS]
    for step in wanted:
        name = "redis" if step == "base" else step
        if check(name, log) is None or not install:
            continue
        if step == "lmcache" and check("lmcache", log) is not None:
            _run([*pip, TORCH], log, 1200)  # the CPU torch first, from the local wheel
        _run(pip + STEPS[step], log, 1800)
    if "redis" in peers and shutil.which("redis-server") is None and install:
        _apt(["redis-server"], log)
    for peer in peers:
        reason = check(peer, log)
        if peer == "mooncake" and reason is not None and ".so" in reason:
            if install:
                _apt(MOONCAKE_LIBS, log)
                reason = check(peer, log)
        if peer == "redis" and reason is None and shutil.which("redis-server") is None:
            reason = "redis-server not installed (apt-get install redis-server)"
        if peer == "mooncake" and reason is None and mooncake_master() is None:
            reason = "mooncake_master binary not found in the bench venv"
        reasons[peer] = reason
    return reasons


def mooncake_master() -> str | None:
    path = VENV / "bin" / "mooncake_master"
    return str(path) if path.exists() else None
