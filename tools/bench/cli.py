"""``python -m tools.bench``: run every workload against kvstored, the same-run limits and the peers.

Every server (kvstored daemons, redis-server, Mooncake master and holder) is started here on
loopback or a Unix socket and stopped at the end, on error and on SIGTERM/SIGINT too. Each
contender runs in a worker process; a contender that cannot run gets its reason in the table.

``python -m tools.bench SUBCOMMAND [options]`` runs one of the focused benchmarks instead
(SUBCOMMANDS, listed by --help), each a module of this package with its own options and output.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tools.bench import chart, peerenv, report
from tools.bench.common import (
    REPO_ROOT,
    GiB,
    MiB,
    Procs,
    free_port,
    python_env,
    run_worker,
    tail,
    tcp_ready,
    wait_for,
    write_json,
)

DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
SIZES = (2 * MiB, 256 << 10)
ALL_PEERS = ("redis", "mooncake", "lmcache")
# subcommand -> (module with main(argv) -> exit status, what it measures)
SUBCOMMANDS = {
    "ssd": ("tools.bench.ssd", "SSD tier vs raw O_DIRECT disk; a daemon's load/stream from SSD"),
    "lookup": ("tools.bench.lookup", "the store's lookup hot path in-process, per eviction policy"),
    "copy": ("tools.bench.copy_engine", "the daemon's copy engine in-process: batches of blocks, whole or per layer"),
    "pages": ("tools.bench.arena_pages", "copies into/out of the arena on 4 KiB vs huge pages, beside heap memory"),
    "gc": ("tools.bench.gc_pause", "the garbage collector's pause over a large index, before/after the freeze"),
    "model": ("tools.bench.model", "TTFT of a real model: restored from DRAM vs fresh prefill"),
    "peers": ("tools.bench.peer_channel", "peer block channel (plain, mutual TLS) vs raw TCP vs Mooncake TCP"),
    "cluster": ("tools.bench.cluster", "two daemons: shipping vs raw TCP / Mooncake; first vs last block"),
    "tiering": ("tools.bench.tiering", "TTFT served from DRAM, SSD, a peer vs recomputed; the tiering break-even"),
    "migration": ("tools.bench.migration", "prefill/decode: the whole prefix after the prefill vs pipelined, TTFT"),
    "gpu": ("tools.bench.gpu", "GPU copies through the daemon vs plain cudaMemcpyAsync (CUDA hosts)"),
    "saves": ("tools.bench.saves", "save into a filling vs a full DRAM tier: what making room costs a save"),
    "burst": ("tools.bench.burst", "saves faster than the disk: saves/s, waits for room, drops, kill -9 losses"),
    "transports": ("tools.bench.transports", "small calls over gRPC, ZeroMQ and plain frames vs the raw socket floor"),
    "vllm": ("tools.bench.vllm_ttft", "TTFT through real vLLM (CPU): cold, from kvstored DRAM/SSD, vLLM's own cache"),
    "vllm-decode": ("tools.bench.vllm_decode", "prefill/decode in real vLLM over a slow link: the wait rule vs whole"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    epilog = "subcommands (python -m tools.bench SUBCOMMAND --help for each one's options):\n" + "\n".join(
        f"  {name:<11} {summary}" for name, (_, summary) in SUBCOMMANDS.items())
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small working sets and few samples (about a minute); peers only if already installed")
    p.add_argument("--no-peers", action="store_true", help="skip Redis, Mooncake and LMCache")
    p.add_argument("--peers", default=",".join(ALL_PEERS), help="comma-separated subset of redis,mooncake,lmcache")
    p.add_argument("--no-install", action="store_true", help="never create or install into .bench/venv")
    p.add_argument("--results-dir", default=str(REPO_ROOT / "results"),
                   help="parent of the bench-<timestamp>/ output folder (default: results/)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE),
                   help="conversation trace JSONL "
                        "(default: ../shared/traces/conversation_trace.jsonl from the repo root)")
    p.add_argument("--trace-window-s", type=float, default=None, help="seconds of trace to replay")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (>= 5 for the report)")
    p.add_argument("--ws-mib", type=int, default=None, help="put/get working set per block size, MiB")
    p.add_argument("--shm-dir", default="",
                   help="shared-memory directory for the daemons' arenas and the benchmark's buffers "
                        "(default: the daemon's, /dev/shm)")
    p.add_argument("--daemon-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra config for every kvstored daemon started (repeatable), e.g. ssd.enabled=false")
    p.add_argument("--only", default="", help="comma-separated workloads: putget,prefix,trace,smallcall,index")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be positive")
    return a


# The put/get passes write fresh keys every run and read each once, relying on eviction to make
# room: LRU drops the oldest run. The default `credit` policy would keep the previous run's
# once-read blocks (they earned credit) and evict the new ones before their get, which measures
# the policy (BENCHMARKS.md §3), not the copy path.
PUTGET_DAEMON_SET = ["dram.policy=lru"]


class Plan:
    """Sizes for a full or a quick run."""

    def __init__(self, a: argparse.Namespace) -> None:
        q = a.quick
        self.runs = a.runs
        self.ws = (a.ws_mib * MiB) if a.ws_mib else (64 * MiB if q else 1 * GiB)
        self.max_ops = 48 if q else 1024
        # same calls per pass as every other contender: with 96, LMCache's batch-1 passes moved
        # 24 MiB (256 KiB blocks) or 192 MiB instead of 256 MiB / 1 GiB, cache-resident and ~20 ms long
        self.lmcache_max_ops = self.max_ops
        self.dram = max(256 * MiB, 2 * self.ws + 256 * MiB)
        self.prefix_requests = 4 if q else 20
        self.prefix_samples = 20 if q else 200
        self.trace_window = a.trace_window_s if a.trace_window_s is not None else (20.0 if q else 600.0)
        self.trace_runs = self.runs
        self.small_calls = 100 if q else 1000
        self.index_blocks = 100_000 if q else 1_000_000
        self.worker_timeout = 300 if q else 1500


@contextlib.contextmanager
def daemon(procs: Procs, tmp: Path, logs: Path, name: str, capacity: int,
           extra: list[str] | None = None) -> Iterator[str]:
    """A fresh kvstored daemon: its own Unix socket and its own (empty) state directory, so no
    block or namespace of another daemon on this machine is recovered. Yields the socket path."""
    sock = tmp / f"{name}.sock"
    argv = [sys.executable, "-m", "kvstored", "--no-config", "--socket", str(sock), "--dram-capacity", str(capacity),
            "--set", "dram.page_bytes=32MiB", "--log-level", "warning"]
    if os.environ.get("KVSTORED_SHM_DIR"):
        argv += ["--set", f"dram.shm_dir={os.environ['KVSTORED_SHM_DIR']}"]
    for item in extra or []:
        argv += ["--set", item]
    env = python_env()
    env.pop("STATE_DIRECTORY", None)
    env["XDG_STATE_HOME"] = str(tmp / f"state-{name}")
    proc = procs.start(f"kvstored-{name}", argv, log=logs / f"daemon-{name}.log", cwd=REPO_ROOT, env=env)

    def ready() -> bool:
        if not sock.exists():
            return False
        with socket.socket(socket.AF_UNIX) as s:
            if s.connect_ex(str(sock)) != 0:
                return False
        # serving, not only listening: it binds its socket before it pre-faults its arena (more
        # than a client's 5 s on a busy machine)
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"unix:{sock}") as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
            except grpc.RpcError:
                return False
        return bool(status == health_pb2.HealthCheckResponse.SERVING)

    try:
        wait_for(ready, 60, f"kvstored daemon ({tail(logs / f'daemon-{name}.log')})", proc)
        yield str(sock)
    finally:
        procs.stop(proc)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.plan = Plan(a)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(a.results_dir).resolve() / f"bench-{stamp}"
        self.out.mkdir(parents=True, exist_ok=False)
        self.logs = self.out / "logs"
        self.logs.mkdir()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvbench-"))
        self.procs = Procs()
        self.only = {w for w in a.only.split(",") if w}
        self.results: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": a.quick, "runs": self.plan.runs,
            "working_set_bytes": self.plan.ws, "machine": _machine(), "daemon_set": a.daemon_set,
            "putget": [], "streams": None, "skipped": {}, "errors": {}}

    def want(self, workload: str) -> bool:
        return not self.only or workload in self.only

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def step(self, name: str, fn: Any, *args: Any) -> Any:
        self.log(f"{name} ...")
        t0 = time.monotonic()
        try:
            value = fn(*args)
        except Exception as exc:
            self.results["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
            with open(self.logs / "harness.log", "a") as fh:
                fh.write(f"{name}:\n{traceback.format_exc()}\n")
            self.log(f"{name} failed: {exc}")
            return None
        self.log(f"{name} done in {time.monotonic() - t0:.1f} s")
        return value

    def worker(self, name: str, argv: list[str], python: str = sys.executable,
               env: dict[str, str] | None = None) -> dict[str, Any]:
        out = self.tmp / f"{name}.json"
        data = run_worker([python, *argv, "--out", str(out)], out, self.plan.worker_timeout,
                          self.logs / f"{name}.log", env or python_env())
        if "error" in data and not data.get("results"):
            raise RuntimeError(data["error"])
        return data

    # -- workload 1 -------------------------------------------------------------------------
    def putget_args(self, impl: str, sizes: tuple[int, ...], max_ops: int | None = None) -> list[str]:
        p = self.plan
        return ["-m", "tools.bench.putget", "--impl", impl, "--sizes", ",".join(map(str, sizes)),
                "--ws-bytes", str(p.ws), "--runs", str(p.runs), "--max-ops", str(max_ops or p.max_ops),
                "--deadline-s", str(p.worker_timeout - 30)]

    def add_putget(self, contender: str, data: dict[str, Any], error: str | None = None) -> None:
        self.results["putget"].append({"contender": contender, "results": data.get("results", []),
                                       "notes": data.get("notes", ""), "error": error or data.get("error")})

    def run_memcpy(self) -> None:
        self.add_putget("memcpy", self.worker("putget-memcpy", self.putget_args("memcpy", SIZES)))

    def run_streams(self) -> None:
        p = self.plan
        data = self.worker("streams", ["-m", "tools.bench.streams", "--ws", str(p.ws), "--per-run", str(p.ws),
                                       "--runs", str(p.runs), "--sizes", ",".join(map(str, SIZES))])
        self.results["streams"] = data["results"]

    def run_kvstored(self, impl: str, label: str) -> None:
        merged: dict[str, Any] = {"results": []}
        errors = []
        # A fresh daemon per block size: see the report's note on slot-size classes.
        for size in SIZES:
            try:
                with daemon(self.procs, self.tmp, self.logs, f"{impl}-{size}", self.plan.dram,
                            [*PUTGET_DAEMON_SET, *self.a.daemon_set]) as sock:
                    data = self.worker(f"putget-{impl}-{size}", [*self.putget_args(impl, (size,)), "--socket", sock])
                merged["results"] += data.get("results", [])
                if data.get("error"):
                    errors.append(data["error"])
            except Exception as exc:
                errors.append(f"{size} B blocks: {exc}")
        self.add_putget(label, merged, "; ".join(errors) or None)

    # -- workloads 2-5 ----------------------------------------------------------------------
    def run_reuse(self) -> None:
        p = self.plan
        trace = Path(self.a.trace)
        capacity = max(512 * MiB, min(2 * GiB, p.dram))
        with daemon(self.procs, self.tmp, self.logs, "reuse", capacity, self.a.daemon_set) as sock:
            if self.want("smallcall"):
                self.results["smallcall"] = self.step("small calls", self.worker, "smallcall", [
                    "-m", "tools.bench.reuse", "smallcall", "--socket", sock, "--runs", str(p.runs),
                    "--calls", str(p.small_calls)])
            if self.want("prefix"):
                self.results["prefix"] = self.step("prefix reuse", self.worker, "prefix", [
                    "-m", "tools.bench.reuse", "prefix", "--socket", sock, "--runs", str(p.runs),
                    "--requests", str(p.prefix_requests), "--samples", str(p.prefix_samples)])
            if self.want("trace"):
                if not trace.is_file():
                    self.results["skipped"]["trace replay"] = f"trace file {trace} not found (--trace PATH)"
                else:
                    self.results["trace"] = self.step("trace replay", self.worker, "trace", [
                        "-m", "tools.bench.reuse", "trace", "--socket", sock, "--runs", str(p.trace_runs),
                        "--trace", str(trace), "--window-s", str(p.trace_window)])

    def run_index(self) -> None:
        self.results["index"] = self.worker("index", ["-m", "tools.bench.index_mem",
                                                      "--blocks", str(self.plan.index_blocks)])

    # -- peers ------------------------------------------------------------------------------
    def run_peers(self) -> None:
        a = self.a
        peers = [] if a.no_peers else [x for x in a.peers.split(",") if x]
        unknown = set(peers) - set(ALL_PEERS)
        if unknown:
            raise SystemExit(f"unknown peers: {', '.join(sorted(unknown))}")
        for peer in ALL_PEERS:
            if peer not in peers:
                self.results["skipped"][peer] = "not requested (--no-peers / --peers)"
        if not peers:
            return
        install = not a.quick and not a.no_install
        self.log(f"peer environment ({'installing where missing' if install else 'no installs'}) ...")
        reasons = peerenv.ensure(peers, install, self.logs / "peerenv.log")
        py = str(peerenv.PY)
        env = python_env()
        env.update(LMCACHE_LOG_LEVEL="ERROR", LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED="0")
        for peer in peers:
            label = report.PEER_LABELS[peer]
            if reasons.get(peer):
                why = reasons[peer]
                if a.quick and not peerenv.PY.exists():
                    why = "skipped in --quick: not installed yet (a full run installs it)"
                self.add_putget(label, {}, f"cannot run: {why}")
                continue
            ran = self.step(label, getattr(self, f"peer_{peer}"), py, env, label)
            if ran is None and label in self.results["errors"]:
                self.add_putget(label, {}, f"failed: {self.results['errors'].pop(label)}")

    def peer_redis(self, py: str, env: dict[str, str], label: str) -> bool:
        port = free_port()
        server = shutil.which("redis-server")
        assert server is not None
        proc = self.procs.start("redis", [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no", "--protected-mode", "yes", "--dir", str(self.tmp)],
                                log=self.logs / "redis-server.log")
        try:
            wait_for(tcp_ready(port), 30, "redis-server", proc)
            data = self.worker("putget-redis", [*self.putget_args("redis", SIZES), "--port", str(port)], py, env)
            self.add_putget(label, data)
        finally:
            self.procs.stop(proc)
        return True

    def peer_mooncake(self, py: str, env: dict[str, str], label: str) -> bool:
        rpc, http = free_port(), free_port()
        master = peerenv.mooncake_master()
        assert master is not None
        m = self.procs.start("mooncake-master", [
            master, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
            "--default_kv_lease_ttl=500"], log=self.logs / "mooncake-master.log")
        holder = None
        try:
            wait_for(tcp_ready(rpc), 60, "mooncake_master", m)
            holder_log = self.logs / "mooncake-holder.log"
            segment = 4 * self.plan.ws + 512 * MiB  # three runs of keys alive at most, plus slack
            holder = self.procs.start("mooncake-holder", [
                py, "-m", "tools.bench.peer_stores", "mooncake-holder", "--port", str(rpc),
                "--segment-bytes", str(segment), "--seconds", str(self.plan.worker_timeout * 2)],
                log=holder_log, cwd=REPO_ROOT, env=env)
            wait_for(lambda: "HOLDER READY" in holder_log.read_text(errors="replace"), 120,
                     f"mooncake holder ({tail(holder_log)})", holder)
            data = self.worker("putget-mooncake", [*self.putget_args("mooncake", SIZES), "--port", str(rpc)],
                               py, env)
            self.add_putget(label, data)
            return True
        finally:
            if holder is not None:
                self.procs.stop(holder)
            self.procs.stop(m)

    def peer_lmcache(self, py: str, env: dict[str, str], label: str) -> bool:
        data = self.worker("putget-lmcache", self.putget_args("lmcache", SIZES, self.plan.lmcache_max_ops),
                           py, env)
        self.add_putget(label, data)
        return True

    # -- all --------------------------------------------------------------------------------
    def run(self) -> Path:
        self.log(f"results in {self.out}")
        try:
            if self.want("putget"):
                self.step("memcpy limit", self.run_memcpy)
                self.step("socket stream limits", self.run_streams)
                self.step("kvstored save/load", self.run_kvstored, "kvstored-arena", report.KV_ARENA)
                self.step("kvstored save(wait=False)/load", self.run_kvstored, "kvstored-behind", report.KV_BEHIND)
                self.step("kvstored save_blocks/load_blocks", self.run_kvstored, "kvstored-registered",
                          report.KV_REG)
            if self.want("smallcall") or self.want("prefix") or self.want("trace"):
                self.step("reuse workloads", self.run_reuse)
            if self.want("index"):
                self.step("index memory", self.run_index)
            if self.want("putget"):
                self.step("peers", self.run_peers)
        finally:
            self.procs.stop_all()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            write_json(self.out / "results.json", self.results)
            (self.out / "results.md").write_text(report.markdown(self.results))
            why = chart.render("putget", self.out / "results.json", self.out / "chart.png", self.logs / "chart.log")
            if why is not None:
                (self.out / "chart.txt").write_text(f"skipped: {why}\n")
            self.log(f"chart: {self.out / 'chart.png' if why is None else why}")
        return self.out


def _machine() -> str:
    import platform

    return f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}"


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.bench [SUBCOMMAND] [options]``; the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[args[0]][0])
        status: int = module.main(args[1:])
        return status
    a = parse_args(args)
    if a.shm_dir:  # the daemons (dram.shm_dir) and the SDK's shm buffers must agree
        os.environ["KVSTORED_SHM_DIR"] = str(Path(a.shm_dir).resolve())
    signal.signal(signal.SIGTERM, _raise_exit)
    bench = Bench(a)
    out = bench.run()
    print(f"table: {out / 'results.md'}")
    return 0
