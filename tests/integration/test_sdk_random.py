"""A seeded, model-based randomized test of a real daemon driven through the SDK from several
threads and clients, with daemon restarts (SIGTERM and SIGKILL) and freezes (SIGSTOP) at random
moments.

Block contents are a pure function of the block's key (and its namespace), so every byte read back
(``load``, ``stream``, ``load_blocks`` into registered buffers) can be checked: a miss is fine,
wrong bytes never are. Errors a client must expect while the daemon is down or restarting
(DaemonNotRunning, DeadlineExceeded, an unknown session or namespace) are allowed and counted, as
are ClientClosed for a client this test closed and NotFound for buffers it unregistered;
anything else is a finding. After the run: no thread hung, nothing stays leased, no client is
left, the daemon's log has no traceback, and after a final restart what it serves is correct.

``KVSTORED_SDK_RANDOM_SEEDS=N`` runs seeds 0..N-1 (default: a few); ``python
tests/integration/test_sdk_random.py FIRST COUNT`` runs seeds from the command line.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if __name__ == "__main__":   # run as a script: find the tests' helpers as pytest does
    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from random_model import content, daemon_trouble, fill_block, make_prompts, read_block, relaunch, settle

import kvstored
from conftest import Daemon, start_daemon
from kvstored import Namespace
from kvstored_client.contract.errors import Reason

TIMEOUT_S = 4.0                  # the clients' timeout_s: a daemon that stops answering costs this
RESTART_GRACE_S = 2 * TIMEOUT_S  # errors of a restart still allowed this long after it
THREAD_BOUND_S = 150.0           # a worker thread not done by then hung
ARENA_NS = Namespace(model="rnd-arena", block_bytes=8192)
BUF_NS = Namespace(model="rnd-bufs", kv_dtype="float16")
LAYERS, HEADS, DIM = 2, 2, 16    # per layer (2, blocks, 16, HEADS, DIM) float16: 2 KiB per block a layer
BUF_BLOCK_BYTES = LAYERS * 2 * 16 * HEADS * DIM * 2
MAX_BLOCKS = 10                  # blocks per prompt
DAEMON_ARGS = ("--dram-capacity", "512KiB", "--set", "dram.page_bytes=64KiB", "--ssd-capacity", "1MiB",
               "--set", "log.level=info")

@dataclass
class Run:
    """What the threads share: the daemon, the clients, registrations, counters and findings."""

    daemon: Daemon
    seed: int
    prompts: list[np.ndarray]
    tensors: list[Any]          # kvstored.shm tensors, registered by every client
    threads: int
    clients: list[kvstored.Client] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    buffers: dict[int, kvstored.Buffers] = field(default_factory=dict)   # id(client) -> registration
    unregistered: set[int] = field(default_factory=set)   # id(registration) of buffers this test dropped
    closed: set[int] = field(default_factory=set)         # id(client) of clients this test closed
    kept: list[Any] = field(default_factory=list)         # those, so that their ids stay theirs
    restarts: list[tuple[float, float]] = field(default_factory=list)  # (stop, serving again)
    down_since: float | None = None
    expected: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    checked_blocks: int = 0
    restarts_done: threading.Event = field(default_factory=threading.Event)
    final_stats: dict[str, Any] = field(default_factory=dict)
    elapsed: float = 0.0

    def new_client(self) -> kvstored.Client:
        deadline = time.monotonic() + 30
        while True:
            try:
                return kvstored.Client(self.daemon.socket, timeout_s=TIMEOUT_S)
            except kvstored.DaemonNotRunning:   # down for a restart
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        return kvstored.block_hashes(tokens)

    def near_restart(self, start: float, end: float) -> bool:
        with self.lock:
            if self.down_since is not None:
                return True
            return any(stop <= end and start <= up + RESTART_GRACE_S for stop, up in self.restarts)

    def finding(self, what: str) -> None:
        with self.lock:
            self.findings.append(f"seed {self.seed}: {what}")


class Worker:
    def __init__(self, run: Run, index: int, ops: int) -> None:
        self.run = run
        self.index = index
        self.n_ops = ops
        self.rng = random.Random(run.seed * 1000 + index)
        # this thread's blocks of the shared tensors: sources of saves, then destinations of loads
        self.src = index * 2 * MAX_BLOCKS
        self.dst = self.src + MAX_BLOCKS
        self.in_use = 0   # id of the registration the current operation uses

    # -- helpers ---------------------------------------------------------------------------------
    def client(self) -> kvstored.Client:
        with self.run.lock:
            return self.rng.choice(self.run.clients)

    def bufs(self, c: kvstored.Client) -> kvstored.Buffers:
        with self.run.lock:
            b = self.run.buffers.get(id(c))
        if b is None:
            b = c.register_buffers([t.numpy() for t in self.run.tensors], 1, namespace=BUF_NS)
            with self.run.lock:
                b = self.run.buffers.setdefault(id(c), b)
        self.in_use = id(b._registration)
        return b

    def check_rows(self, what: str, tag: str, tokens: np.ndarray, first: int, rows: list[np.ndarray]) -> None:
        keys = self.run.keys(tokens)
        if first + len(rows) > len(keys):
            self.run.finding(f"{what}: {first + len(rows)} blocks read back for a prompt of {len(keys)}")
            return
        for i, row in enumerate(rows):
            want = content(tag, keys[first + i], row.size)
            if not np.array_equal(row, want):
                self.run.finding(f"{what}: block {first + i} of {len(keys)} has wrong bytes "
                                 f"({int(np.count_nonzero(row != want))} of {row.size} differ)")
                return
        with self.run.lock:
            self.run.checked_blocks += len(rows)

    # -- operations ------------------------------------------------------------------------------
    def op_save(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        keys = self.run.keys(tokens)
        kv = np.stack([content("arena", k, ARENA_NS.block_bytes) for k in keys]) if keys else \
            np.zeros((0, ARENA_NS.block_bytes), np.uint8)
        # half of them without waiting for the answer: the next call on this client reads it first
        r = c.save(tokens, kv, namespace=ARENA_NS, wait=self.rng.random() < 0.5)
        if r.present + r.stored > len(keys):
            self.run.finding(f"save: {r} for {len(keys)} blocks")

    def op_load(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        out = None
        if self.rng.random() < 0.5:
            out = np.full((MAX_BLOCKS, ARENA_NS.block_bytes), 0xEE, np.uint8)
        r = c.load(tokens, namespace=ARENA_NS, out=out)
        self.check_rows("load", "arena", tokens, 0, list(r.data))
        if out is not None and r.blocks and not np.shares_memory(r.data, out):
            self.run.finding("load: data is not a view of out")

    def op_save_blocks(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        b = self.bufs(c)
        keys = self.run.keys(tokens)
        ids = list(range(self.src, self.src + len(keys)))
        self.rng.shuffle(ids)
        for k, block in zip(keys, ids):
            fill_block(self.run.tensors, block, content("bufs", k, BUF_BLOCK_BYTES))
        r = c.save_blocks(b, ids, tokens)
        if r.present + r.stored > len(keys):
            self.run.finding(f"save_blocks: {r} for {len(keys)} blocks")

    def _dst_ids(self, n: int) -> list[int]:
        ids = list(range(self.dst, self.dst + MAX_BLOCKS))
        self.rng.shuffle(ids)
        for block in range(self.dst, self.dst + MAX_BLOCKS):
            fill_block(self.run.tensors, block, np.full(BUF_BLOCK_BYTES, 0xEE, np.uint8))
        return ids[:n]

    def _check_dst(self, what: str, tokens: np.ndarray, ids: list[int], loaded: int) -> None:
        self.check_rows(what, "bufs", tokens, 0, [read_block(self.run.tensors, b) for b in ids[:loaded]])
        keys = self.run.keys(tokens)
        layer = BUF_BLOCK_BYTES // LAYERS
        for i, b in enumerate(ids[loaded:], start=loaded):
            # Past the loaded prefix a block is untouched, or (a layer at a time) holds its own
            # bytes: blocks copied early, as they came up from SSD, before the lookup's lease
            # ended are not reported as loaded. Anything else there is a wrong write.
            got, want = read_block(self.run.tensors, b), content("bufs", keys[i], BUF_BLOCK_BYTES)
            if any(not (got[j:j + layer] == 0xEE).all() and not np.array_equal(got[j:j + layer], want[j:j + layer])
                   for j in range(0, BUF_BLOCK_BYTES, layer)):
                self.run.finding(f"{what}: engine block {b} (block {i} of the prompt) written with other bytes "
                                 f"though only {loaded} blocks were loaded")
                return

    def op_load_blocks(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        b = self.bufs(c)
        ids = self._dst_ids(len(self.run.keys(tokens)))
        if self.rng.random() < 0.5:
            r = c.load_blocks(b, ids, tokens)
            what = "load_blocks"
        else:
            handle = c.load_blocks(b, ids, tokens, wait=False)
            what = "load_blocks(wait=False)"
            if self.rng.random() < 0.5:
                handle.wait_layer(self.rng.randrange(LAYERS), timeout=60)
            r = handle.wait(timeout=60)
        self._check_dst(what, tokens, ids, r.blocks)

    def op_stream(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        n = len(self.run.keys(tokens))
        leave = self.rng.randrange(n + 1) if self.rng.random() < 0.3 else None
        if self.rng.random() < 0.1:   # closed before its loop: nothing may stay leased
            c.stream(tokens, namespace=ARENA_NS, peers=False).close()
        elif self.rng.random() < 0.5:
            s = c.stream(tokens, namespace=ARENA_NS, peers=False)
            expect = 0
            for arrival in s:
                if arrival.index != expect:
                    self.run.finding(f"stream: block {arrival.index} arrived where {expect} was due")
                expect += 1
                self.check_rows("stream", "arena", tokens, arrival.index, [arrival.data])
                if leave is not None and expect >= leave:
                    break
            if leave is None and (s.outcome is None or s.outcome.blocks != expect):
                self.run.finding(f"stream: {expect} arrivals, outcome {s.outcome} (client closed: "
                                 f"{id(c) in self.run.closed})")
        else:
            b = self.bufs(c)
            ids = self._dst_ids(n)
            s = c.stream(tokens, buffers=b, block_ids=ids, peers=False)
            got = 0
            for arrival in s:
                if arrival.index != got or arrival.data is not None:
                    self.run.finding(f"stream(buffers): {arrival} where block {got} was due")
                got += 1
                if leave is not None and got >= leave:
                    break
            if leave is None:
                if s.outcome is None or s.outcome.blocks != got:
                    self.run.finding(f"stream(buffers): {got} arrivals, outcome {s.outcome}")
                self._check_dst("stream(buffers)", tokens, ids, got)

    def op_lookup(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        ns = self.rng.choice([ARENA_NS, self.bufs(c).namespace])
        r = c.prefetch(tokens, namespace=ns) if self.rng.random() < 0.3 else c.lookup(tokens, namespace=ns)
        if r.blocks > len(self.run.keys(tokens)):
            self.run.finding(f"lookup/prefetch: {r} for {len(self.run.keys(tokens))} blocks")

    def op_evict(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        c.evict(model=self.rng.choice(["", ARENA_NS.model, BUF_NS.model]),
                tier=self.rng.choice([None, "dram", "ssd"]))

    def op_flush(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        model = self.rng.choice(["", ARENA_NS.model, BUF_NS.model])
        if self.rng.random() < 0.5:
            c.flush(model)
        else:
            for _ in c.flushing(model):
                if self.rng.random() < 0.5:
                    break   # abandoned midway

    def op_unregister(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        with self.run.lock:
            b = self.run.buffers.pop(id(c), None)
            if b is not None:
                self.run.unregistered.add(id(b._registration))
                self.run.kept.append(b)
        if b is not None:
            c.unregister_buffers(b)

    def op_close(self, c: kvstored.Client, tokens: np.ndarray) -> None:
        fresh = self.run.new_client()
        with self.run.lock:
            if id(c) in self.run.closed:   # another thread closed it meanwhile
                fresh.close()
                return
            self.run.closed.add(id(c))
            self.run.kept.append(c)
            self.run.buffers.pop(id(c), None)
            self.run.clients[self.run.clients.index(c)] = fresh
        c.close()

    OPS: list[tuple[str, float]] = [
        ("save", 5), ("load", 5), ("save_blocks", 4), ("load_blocks", 4), ("stream", 4),
        ("lookup", 3), ("evict", 0.3), ("flush", 0.8), ("unregister", 0.5), ("close", 0.4)]

    def __call__(self) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        done = 0
        # at least n_ops, and on while the controller restarts the daemon (bounded all the same)
        while done < self.n_ops or (not self.run.restarts_done.is_set() and done < 20 * self.n_ops):
            done += 1
            name = self.rng.choices(names, weights)[0]
            tokens = self.rng.choice(self.run.prompts)
            c = self.client()
            with self.run.lock:
                self.run.ops[name] += 1
            start = time.monotonic()
            self.in_use = 0
            try:
                getattr(self, f"op_{name}")(c, tokens)
            except kvstored.KVStoreError as exc:
                self.classify(name, c, exc, start)
                time.sleep(0.02)   # as an engine would, rather than spin while the daemon is down
            except Exception:
                self.run.finding(f"{name}: {traceback.format_exc()}")

    def classify(self, name: str, c: kvstored.Client, exc: kvstored.KVStoreError, start: float) -> None:
        text = str(exc)
        near = self.run.near_restart(start, time.monotonic())
        kind = None
        if isinstance(exc, kvstored.ClientClosed) and id(c) in self.run.closed:
            kind = "closed"
        elif isinstance(exc, kvstored.NotFound) and "unregistered" in text:
            kind = "unregistered"
        elif isinstance(exc, kvstored.NotFound) and text.startswith("unknown buffers") \
                and self.in_use in self.run.unregistered:
            kind = "unregistered meanwhile"   # by another thread, while this call was on its way
        elif near and isinstance(exc, (kvstored.DaemonNotRunning, kvstored.DeadlineExceeded)):
            kind = type(exc).__name__
        elif near and name in ("save", "save_blocks") and isinstance(exc, kvstored.LeaseExpired) \
                and exc.reason == Reason.RESERVATION_EXPIRED:
            # frozen while the save waited for room: its reservation's time ran out meanwhile
            kind = "reservation expired across a freeze"
        elif near and isinstance(exc, kvstored.FailedPrecondition) and "unknown session" in text:
            kind = "unknown session"
        elif near and isinstance(exc, kvstored.NotFound) and "unknown namespace" in text:
            kind = "unknown namespace"
        elif name in ("flush", "evict") and isinstance(exc, kvstored.NotFound) and "no namespace of model" in text:
            kind = "model not known yet"   # since the (re)start, no client opened one of its namespaces
        elif name in ("save", "save_blocks") and isinstance(exc, kvstored.ResourceExhausted) \
                and "DRAM tier full" in text:
            kind = "DRAM full of held blocks"   # a tiny arena, and up to 4 threads each holding a prompt
        elif name == "flush" and isinstance(exc, kvstored.ResourceExhausted):
            kind = "flush: SSD full"
        if kind is None:
            self.run.finding(f"{name}: {type(exc).__name__}: {text} (near a restart: {near}, client closed: "
                             f"{id(c) in self.run.closed})")
        else:
            with self.run.lock:
                self.run.expected[kind] += 1


def controller(run: Run, stop: threading.Event, rng: random.Random, restarts: int) -> None:
    try:
        restart_at_random(run, stop, rng, restarts)
    except Exception:
        run.finding(f"restarting the daemon: {traceback.format_exc()}\n{run.daemon.log()[-3000:]}")
    finally:
        run.restarts_done.set()


def restart_at_random(run: Run, stop: threading.Event, rng: random.Random, restarts: int) -> None:
    for _ in range(restarts):
        if stop.wait(rng.uniform(0.1, 1.0)):
            return
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP])
        with run.lock:
            run.down_since = time.monotonic()
        if sig == signal.SIGSTOP:   # a daemon that stops answering for a while, shorter or longer than timeout_s
            run.daemon.proc.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 1.5 * TIMEOUT_S))
            run.daemon.proc.send_signal(signal.SIGCONT)
        else:
            relaunch(run.daemon, sig)
        with run.lock:
            assert run.down_since is not None
            run.restarts.append((run.down_since, time.monotonic()))
            run.down_since = None


def verify_served(run: Run) -> None:
    """Everything a fresh client reads back, in every way, is the model's bytes."""
    with kvstored.Client(run.daemon.socket, timeout_s=30) as c:
        w = Worker(run, 0, 0)
        with run.lock:
            run.clients = [c]
            run.buffers = {}
        for tokens in run.prompts:
            w.op_load(c, tokens)
            w.op_load_blocks(c, tokens)
            w.op_stream(c, tokens)


def run_seed(seed: int, tmp: Path) -> Run:
    rng = random.Random(seed)
    n_threads = rng.randint(2, 4)
    n_clients = rng.randint(1, 3)
    daemon = start_daemon(tmp, *DAEMON_ARGS)
    tensors = [kvstored.shm.empty((2, n_threads * 2 * MAX_BLOCKS, 16, HEADS, DIM), "float16")
               for _ in range(LAYERS)]
    run = Run(daemon, seed, make_prompts(rng, 32, 4, MAX_BLOCKS), tensors, n_threads)
    try:
        run.clients = [run.new_client() for _ in range(n_clients)]
        workers = [Worker(run, i, rng.randint(100, 200)) for i in range(n_threads)]
        threads = [threading.Thread(target=w, name=f"worker-{i}", daemon=True) for i, w in enumerate(workers)]
        stop = threading.Event()
        ctl = threading.Thread(target=controller, args=(run, stop, random.Random(seed + 7), rng.randint(1, 3)),
                               name="controller", daemon=True)
        for t in [*threads, ctl]:
            t.start()
        began = deadline = time.monotonic() + THREAD_BOUND_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        run.elapsed = time.monotonic() - began + THREAD_BOUND_S
        stop.set()
        ctl.join(60)
        hung = [t for t in threads if t.is_alive()]
        if hung:
            frames = sys._current_frames()
            stacks = "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
                               for t in hung if t.ident in frames)
            run.finding(f"{len(hung)} threads did not finish within {THREAD_BOUND_S:g} s:\n{stacks}")
            return run
        for c in run.clients:
            c.close()
        if daemon.proc.poll() is not None:
            run.finding(f"the daemon exited ({daemon.proc.returncode}) without being stopped:\n{daemon.log()[-4000:]}")
            return run
        with kvstored.Client(daemon.socket, timeout_s=30) as check:
            # (the checking client opens no session: stats needs none)
            stats = run.final_stats = settle(check.stats, lambda s: s["active_leases"] == 0 and s["clients"] == 0)
            if stats["active_leases"] or stats["clients"]:
                run.finding(f"quiet daemon, all clients closed: {stats['active_leases']} active leases, "
                            f"{stats['clients']} clients")
        trouble = daemon_trouble(daemon)
        if trouble:
            run.finding(f"daemon log:\n{trouble}")
        relaunch(daemon, signal.SIGTERM)
        verify_served(run)
        trouble = daemon_trouble(daemon)
        if trouble:
            run.finding(f"daemon log after the final restart:\n{trouble}")
        return run
    finally:
        for c in run.clients:
            c.close()
        daemon.stop(signal.SIGKILL)
        for t in tensors:
            t.close()


def report(run: Run) -> str:
    return (f"seed {run.seed}: {run.threads} threads, ops {dict(run.ops)}, {len(run.restarts)} restarts, "
            f"{run.elapsed:.1f} s, "
            f"expected errors {dict(run.expected)}, {run.checked_blocks} blocks checked, "
            f"last daemon: {summary(run.final_stats)}")


def summary(stats: dict[str, Any]) -> str:
    if not stats:
        return "-"
    tiers = ", ".join(f"{t['name']} {t['evictions']} evictions {t['write_errors']} write errors"
                      for t in stats["tiers"])
    return f"{tiers}, {stats['promotions']} promotions, {stats['demotions']} demotions"


SEEDS = range(int(os.environ.get("KVSTORED_SDK_RANDOM_SEEDS", "3")))


@pytest.mark.parametrize("seed", SEEDS)
def test_sdk_under_threads_and_restarts(seed: int, tmp_path: Path) -> None:
    run = run_seed(seed, tmp_path)
    print(report(run))
    assert not run.findings, "\n\n".join(run.findings[:5])
    assert run.checked_blocks > 0, "nothing was read back: the test checks nothing"


def _iter_seeds(first: int, count: int) -> Iterator[Run]:
    for seed in range(first, first + count):
        with tempfile.TemporaryDirectory() as tmp:
            yield run_seed(seed, Path(tmp))


if __name__ == "__main__":
    first, count = (int(a) for a in (sys.argv[1:3] + ["0", "20"][len(sys.argv[1:3]):]))
    bad = 0
    for run in _iter_seeds(first, count):
        print(report(run), flush=True)
        for f in run.findings[:5]:
            print("  FINDING", f.replace("\n", "\n    "), flush=True)
        bad += bool(run.findings)
    print(f"{bad} of {count} seeds with findings")
    sys.exit(1 if bad else 0)
