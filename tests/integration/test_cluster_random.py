"""A seeded, model-based randomized test of a cluster of two or three real daemons (static peers on
loopback, a shared token), driven through the SDK and ``kvctl`` from several threads, with daemons
killed (SIGKILL), stopped (SIGTERM) or frozen (SIGSTOP/SIGCONT) at random moments, now and then
two at once, and restarted on the same socket, SSD directory and peer port.

Operations: saves from arrays and from engine buffers (some pushed on to another node), loads,
lookups (some asking the peers), streams into arrays and into engine buffers and pulls that fetch
from peers (some left early), migrations of a model or of one prompt (some abandoned midway),
drains, evictions, flushes, clients closed under the other threads, and ``kvctl``
migrate/drain/evict/flush/peers/stats. Sometimes one node runs with a small DRAM and SSD so that
blocks sink to SSD and fall out, and a restarted node may come back with the other capacities
(shrunk or grown, over the same SSD directory).

Block contents are a pure function of the block's key and namespace, so every byte read back on any
node is checked: a miss is fine, wrong bytes never are. Errors a client must expect while a node it
talks to is down or restarting are allowed and counted; anything else is a finding (so are
migrations whose blocks fail with no fault near, streams cut short by a peer with no fault near, a
SIGTERM that does not exit 0 promptly, an operation past OP_BOUND_S). After the run: no thread hung,
no node exited unasked, nothing stays leased and no client is left on any node, no daemon logged a
traceback or an error; then, every node up (one restarted once more): every node sees its peers up,
a drain of one node loses no prefix, every node serves the model's bytes for all it reports as
present (loaded from itself, streamed from itself and its peers, as far as its lookup said), and
with no client left evicting everything empties every node (no pin outlived its holder).

The op sequence is a function of the seed; the moments of the faults (and so the outcomes) are not.
``KVSTORED_CLUSTER_RANDOM_SEEDS=N`` runs seeds 0..N-1 (default: 2); ``python
tests/integration/test_cluster_random.py FIRST COUNT`` runs seeds from the command line.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
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

from loopback import free_ports
from random_model import content, daemon_trouble, fill_block, make_prompts, read_block, relaunch, settle

import kvstored
from conftest import ROOT, Daemon, start_daemon, wait_serving
from kvstored import Namespace
from kvstored_client.contract.errors import Reason
from kvstored_client.results import StreamOutcome

TIMEOUT_S = 5.0                  # the clients' timeout_s
PEER_DEADLINE_S = 2              # peers.deadline_s: a frozen peer costs this
FAULT_GRACE_S = TIMEOUT_S + PEER_DEADLINE_S   # errors of a fault still allowed this long after it
THREAD_BOUND_S = 120.0           # a worker thread not done by then hung
OP_BOUND_S = 45.0                # one operation taking longer is a finding
KVCTL_TIMEOUT_S = 60.0
# a clean stop takes at most about 2 x server.shutdown_grace_s (10 s): in-flight calls, then the
# write-back of DRAM-only blocks; SIGKILL after SIGTERM_BOUND_S
SIGTERM_BOUND_S = 40.0
TOKEN = "crand-t0ken"
NAMESPACES = (Namespace(model="crand-a", block_bytes=8192), Namespace(model="crand-b", block_bytes=4096),
              Namespace(model="crand-c", block_bytes=64 << 10))   # (a transfer of these takes a while)
MAX_BLOCKS = 8                   # blocks per prompt
BUF_NS = Namespace(model="crand-bufs", kv_dtype="float16")   # engine buffers: saved and streamed in place
LAYERS, HEADS, DIM = 2, 2, 16    # per layer (2, blocks, 16, HEADS, DIM) float16: 2 KiB per block a layer
BUF_BLOCK_BYTES = LAYERS * 2 * 16 * HEADS * DIM * 2
COMMON_ARGS = ("--set", "log.level=info", "--set", "dram.page_bytes=64KiB", "--set", f"peers.token={TOKEN}",
               "--set", f"peers.deadline_s={PEER_DEADLINE_S}",
               # (check_unpinned: an ended session's spare slots are free again within its wait)
               "--set", "dram.quarantine_s=1")
ROOMY_ARGS = ("--dram-capacity", "8MiB", "--ssd-capacity", "32MiB")
SMALL_ARGS = ("--dram-capacity", "512KiB", "--ssd-capacity", "1MiB")   # blocks sink to SSD and fall out


@dataclass
class Node:
    """One daemon of the cluster and the faults it went through."""

    name: str
    daemon: Daemon
    small: bool
    client: kvstored.Client | None = None
    faults: list[tuple[float, float]] = field(default_factory=list)   # (fault began, serving again)
    down_since: float | None = None


@dataclass
class Run:
    """What the threads share: the nodes, counters and findings."""

    seed: int
    nodes: list[Node]
    prompts: list[np.ndarray]
    threads: int
    tensors: list[Any]          # kvstored.shm tensors every node's client registers
    lock: threading.Lock = field(default_factory=threading.Lock)
    expected: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    checked_blocks: int = 0
    peer_blocks: int = 0          # of those, arrived from a peer in a stream
    faults_done: threading.Event = field(default_factory=threading.Event)
    buffers: dict[int, kvstored.Buffers] = field(default_factory=dict)   # id(client) -> its registration
    closed: set[int] = field(default_factory=set)          # id() of the clients this test closed
    kept: list[Any] = field(default_factory=list)          # those, so that their ids stay theirs
    final_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    elapsed: float = 0.0

    def near_fault(self, nodes: list[Node], start: float, end: float) -> bool:
        """Whether one of ``nodes`` was down, frozen or restarting during [start, end] (or just before)."""
        with self.lock:
            for n in nodes:
                if n.down_since is not None:
                    return True
                if any(stop <= end and start <= up + FAULT_GRACE_S for stop, up in n.faults):
                    return True
        return False

    def finding(self, what: str) -> None:
        with self.lock:
            self.findings.append(f"seed {self.seed}: {what}")

    def count(self, what: str) -> None:
        with self.lock:
            self.expected[what] += 1


class Worker:
    def __init__(self, run: Run, index: int, ops: int) -> None:
        self.run = run
        self.index = index
        self.n_ops = ops
        self.rng = random.Random(run.seed * 1000 + index)
        self.last_stream: StreamOutcome | None = None
        self.history: list[str] = []   # this thread's last operations and how they ended
        # this thread's blocks of the shared tensors: sources of saves, then destinations of loads
        self.src = index * 2 * MAX_BLOCKS
        self.dst = self.src + MAX_BLOCKS

    # -- helpers ---------------------------------------------------------------------------------
    def other(self, node: Node) -> Node:
        return self.rng.choice([n for n in self.run.nodes if n is not node])

    def check_rows(self, what: str, ns: Namespace, tokens: np.ndarray, first: int, rows: list[np.ndarray]) -> None:
        keys = kvstored.block_hashes(tokens)
        if first + len(rows) > len(keys):
            self.run.finding(f"{what}: {first + len(rows)} blocks read back for a prompt of {len(keys)}")
            return
        for i, row in enumerate(rows):
            want = content(ns.model, keys[first + i], ns.block_bytes or BUF_BLOCK_BYTES)
            if row.shape != want.shape or not np.array_equal(row, want):
                differ = int(np.count_nonzero(row != want)) if row.shape == want.shape else "all"
                self.run.finding(f"{what}: block {first + i} of {len(keys)} of {ns.model} has wrong bytes "
                                 f"({differ} of {want.size} differ)")
                return
        with self.run.lock:
            self.run.checked_blocks += len(rows)

    # -- operations: each returns the nodes it involves beyond its own ---------------------------------
    def op_save(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        keys = kvstored.block_hashes(tokens)
        kv = np.stack([content(ns.model, k, ns.block_bytes) for k in keys]) if keys else \
            np.zeros((0, ns.block_bytes), np.uint8)
        to = self.other(node) if self.rng.random() < 0.3 else None
        r = c.save(tokens, kv, namespace=ns, push_to=to.name if to else "")
        if r.present + r.stored > len(keys):
            self.run.finding(f"save: {r} for {len(keys)} blocks")
        return [to] if to else []

    def op_load(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        r = c.load(tokens, namespace=ns)
        self.check_rows(f"load on {node.name}", ns, tokens, 0, list(r.data))
        return []

    def op_stream(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray,
                  final: bool = False) -> list[Node]:
        n = len(kvstored.block_hashes(tokens))
        leave = self.rng.randrange(n + 1) if self.rng.random() < 0.2 and not final else None
        start = time.monotonic()
        s = c.stream(tokens, namespace=ns, peers=final or self.rng.random() < 0.9)
        expect = 0
        for arrival in s:
            if arrival.index != expect:
                self.run.finding(f"stream on {node.name}: block {arrival.index} arrived where {expect} was due")
            expect += 1
            self.check_rows(f"stream on {node.name} ({arrival.tier} {arrival.peer})", ns, tokens, arrival.index,
                            [arrival.data])
            if arrival.peer:
                with self.run.lock:
                    self.run.peer_blocks += 1
            if leave is not None and expect >= leave:
                s.close()
                break
        if leave is not None:
            return [m for m in self.run.nodes if m is not node]
        end = s.outcome
        if end is None or end.blocks != expect or end.requested != n:
            self.run.finding(f"stream on {node.name}: {expect} arrivals of {n}, outcome {end}")
        elif end.stop in ("corrupt", "refused") or (
                end.stop in ("peer_error", "peer_closed", "unreachable")
                and not self.run.near_fault(self.run.nodes, start, time.monotonic())):
            self.run.finding(f"stream on {node.name}: stopped with no fault near: {end}")
        else:
            self.run.count(f"stream: {end.stop}")
        self.last_stream = end
        return [m for m in self.run.nodes if m is not node]

    def op_pull(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        n = len(kvstored.block_hashes(tokens))
        out = c.pull(tokens, namespace=ns)
        if out.blocks > n or out.requested != n:
            self.run.finding(f"pull on {node.name}: {out} for {n} blocks")
        if self.rng.random() < 0.5:
            self.op_load(node, c, ns, tokens)
        return [m for m in self.run.nodes if m is not node]

    def op_lookup(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        n = len(kvstored.block_hashes(tokens))
        peers = self.rng.random() < 0.5
        r = c.lookup(tokens, namespace=ns, peers=peers)
        if r.blocks > n or any(v > n for v in r.per_peer.values()) or \
                not set(r.per_peer) <= {m.name for m in self.run.nodes if m is not node}:
            self.run.finding(f"lookup on {node.name}: {r} for {n} blocks")
        return [m for m in self.run.nodes if m is not node] if peers else []

    def bufs(self, node: Node, c: kvstored.Client) -> kvstored.Buffers:
        """``c``'s registration of the engine tensors (made on first use)."""
        with self.run.lock:
            b = self.run.buffers.get(id(c))
        if b is None:
            b = c.register_buffers([t.numpy() for t in self.run.tensors], 1, namespace=BUF_NS)
            with self.run.lock:
                b = self.run.buffers.setdefault(id(c), b)
        return b

    def op_save_blocks(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        b = self.bufs(node, c)
        keys = kvstored.block_hashes(tokens)
        ids = list(range(self.src, self.src + len(keys)))
        self.rng.shuffle(ids)
        for k, block in zip(keys, ids):
            fill_block(self.run.tensors, block, content(BUF_NS.model, k, BUF_BLOCK_BYTES))
        r = c.save_blocks(b, ids, tokens)
        if r.present + r.stored > len(keys):
            self.run.finding(f"save_blocks on {node.name}: {r} for {len(keys)} blocks")
        return []

    def op_stream_buffers(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        """A stream into engine buffers, fetching from peers: each block lands in place."""
        b = self.bufs(node, c)
        n = len(kvstored.block_hashes(tokens))
        ids = list(range(self.dst, self.dst + MAX_BLOCKS))
        self.rng.shuffle(ids)
        for block in ids:
            fill_block(self.run.tensors, block, np.full(BUF_BLOCK_BYTES, 0xEE, np.uint8))
        ids = ids[:n]
        start = time.monotonic()
        s = c.stream(tokens, buffers=b, block_ids=ids)
        got = 0
        for arrival in s:
            if arrival.index != got or arrival.data is not None:
                self.run.finding(f"stream(buffers) on {node.name}: {arrival} where block {got} was due")
            got += 1
        others = [m for m in self.run.nodes if m is not node]
        end = s.outcome
        if end is None or end.blocks != got:
            self.run.finding(f"stream(buffers) on {node.name}: {got} arrivals, outcome {end}")
            return others
        what = f"stream(buffers) on {node.name}"
        self.check_rows(what, BUF_NS, tokens, 0, [read_block(self.run.tensors, i) for i in ids[:got]])
        for j, i in enumerate(ids[got:], got):
            row = read_block(self.run.tensors, i)
            if not (row == 0xEE).all():
                which = [(p, x) for p, other in enumerate(self.run.prompts)
                         for x, k in enumerate(kvstored.block_hashes(other))
                         if np.array_equal(row, content(BUF_NS.model, k, BUF_BLOCK_BYTES))]
                self.run.finding(f"{what}: engine block {i} (for block {j}) written though only {got} blocks were "
                                 f"loaded ({int(np.count_nonzero(row != 0xEE))} bytes; the bytes of (prompt, block) "
                                 f"{which}); outcome {end}; this thread's ops before: {self.history[-3:]}")
                break
        if end.stop in ("corrupt", "refused") or (
                end.stop in ("peer_error", "peer_closed", "unreachable")
                and not self.run.near_fault(self.run.nodes, start, time.monotonic())):
            self.run.finding(f"{what}: stopped with no fault near: {end}")
        self.last_stream = end
        return others

    def _migration(self, what: str, progress: Iterator[dict[str, Any]], drain: bool, node: Node,
                   to: list[Node]) -> None:
        """Progress is consistent and ends with a final report; blocks fail only near a fault of a
        node involved, or for want of room on the receiver."""
        start = time.monotonic()
        abandon = self.rng.random() < 0.15
        last: dict[str, Any] = {}
        for p in progress:
            if p["pushed_blocks"] + p["failed_blocks"] > p["total_blocks"] or \
                    p["dropped_blocks"] > p["total_blocks"] or (not drain and p["dropped_blocks"]):
                self.run.finding(f"{what}: progress {p}")
            if last and (p["pushed_blocks"] < last["pushed_blocks"] or p["failed_blocks"] < last["failed_blocks"]):
                self.run.finding(f"{what}: progress went back from {last} to {p}")
            last = p
            if abandon:
                break
        if abandon:
            return
        if not last.get("done"):
            self.run.finding(f"{what}: ended without a final report (last {last})")
        elif last["failed_blocks"]:
            if self.run.near_fault([node, *to], start, time.monotonic()):
                self.run.count("migration: blocks failed near a fault")
            elif "full" in last["detail"]:
                self.run.count("migration: receiver full")
            elif "no longer held here" in last["detail"]:
                self.run.count("migration: evicted meanwhile")   # by another thread, or to make room
            elif "the block before it is not held here" in last["detail"]:
                self.run.count("migration: receiver evicted the parent meanwhile")
            else:
                self.run.finding(f"{what}: {last['failed_blocks']} blocks failed, no fault near: {last}")

    def op_migrate(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        to = self.other(node)
        how = self.rng.choice(["model", "all", "prompt"])
        if how == "prompt":
            progress = c.migrate(to.name, tokens=tokens, namespace=ns)
        else:
            progress = c.migrate(to.name, model=ns.model if how == "model" else "")
        self._migration(f"migrate {node.name} -> {to.name} ({how})", progress, False, node, [to])
        return [to]

    def op_drain(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        to = self.other(node) if self.rng.random() < 0.3 else None
        if self.rng.random() < 0.3:
            progress = c.migrate(drain=True, tokens=tokens, namespace=ns)
            what = "prompt"
        else:
            progress = c.migrate(to.name if to else "", drain=True)
            what = "all"
        involved = [to] if to else [m for m in self.run.nodes if m is not node]
        self._migration(f"drain {node.name} -> {to.name if to else 'peers'} ({what})", progress, True, node, involved)
        return involved

    def op_evict(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        c.evict(model=self.rng.choice(["", ns.model, BUF_NS.model]), tier=self.rng.choice([None, "dram", "ssd"]))
        return []

    def op_flush(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        model = self.rng.choice(["", ns.model])
        leave = self.rng.choice([None, None, 1, 2])   # (drawn up front: the op sequence stays the seed's)
        if leave is None:
            c.flush(model)
        else:
            for i, _ in enumerate(c.flushing(model), 1):
                if i >= leave:
                    break   # abandoned midway
        return []

    def op_kvctl(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        """kvctl in a subprocess: exit 0, or 1 with one line on stderr; never a traceback."""
        to = self.other(node)
        args, involved = self.rng.choice([
            (["migrate", to.name, "--model", ns.model], [to]),
            (["migrate", to.name], [to]),
            (["drain"], [m for m in self.run.nodes if m is not node]),
            (["drain", "--to", to.name], [to]),
            (["evict", "--model", ns.model, "--tier", self.rng.choice(["dram", "ssd", "all"])], []),
            (["flush"], []),
            (["peers", "--json"], [m for m in self.run.nodes if m is not node]),
            (["stats", "--json"], []),
        ])
        env = {**os.environ, "COLUMNS": "120"}
        try:
            out = subprocess.run([sys.executable, "-m", "kvstored.kvctl", "--socket", node.daemon.socket, *args],
                                 capture_output=True, text=True, timeout=KVCTL_TIMEOUT_S, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            self.run.finding(f"kvctl {' '.join(args)} on {node.name}: not done in {KVCTL_TIMEOUT_S:g} s")
            return involved
        if "Traceback" in out.stderr or out.returncode not in (0, 1):
            self.run.finding(f"kvctl {' '.join(args)} on {node.name}: exit {out.returncode}:\n{out.stderr[-3000:]}")
        elif out.returncode == 1:
            # a refusal is one "kvctl: " line on stderr; a migration with failed blocks says so on stdout
            err = [line for line in out.stderr.splitlines() if line.startswith("kvctl: ")]
            raise KvctlFailed(" ".join(args), err[-1] if err else out.stdout.strip()[-500:])
        return involved

    def op_close(self, node: Node, c: kvstored.Client, ns: Namespace, tokens: np.ndarray) -> list[Node]:
        """Replace the node's client (shared by the threads) by a new one and close the old one,
        whatever the other threads are doing with it: its session ends, its streams and fetches
        from peers stop, nothing it held stays leased."""
        fresh = kvstored.Client(node.daemon.socket, timeout_s=TIMEOUT_S)
        with self.run.lock:
            if node.client is not c:   # another thread replaced it meanwhile
                self.run.kept.append(fresh)
                stale = fresh
            else:
                node.client = fresh
                self.run.closed.add(id(c))
                self.run.kept.append(c)
                stale = c
        stale.close()
        return []

    OPS: list[tuple[str, float]] = [
        ("save", 6), ("load", 3), ("stream", 5), ("pull", 1.5), ("lookup", 2), ("migrate", 1.2),
        ("drain", 0.5), ("evict", 0.4), ("flush", 0.5), ("kvctl", 0.3), ("save_blocks", 2), ("stream_buffers", 2),
        ("close", 0.3)]

    def __call__(self) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        done = 0
        quiet = 0
        # on while the controller injects faults (at least half of n_ops; bounded all the same),
        # then the other half after the last fault: when the grace of the faults ends, every
        # allowance for them ends too
        while quiet < self.n_ops - self.n_ops // 2:
            if done >= self.n_ops // 2 and (self.run.faults_done.is_set() or done >= 10 * self.n_ops):
                quiet += 1
            done += 1
            name = self.rng.choices(names, weights)[0]
            node = self.rng.choice(self.run.nodes)
            ns = self.rng.choice(NAMESPACES)
            tokens = self.rng.choice(self.run.prompts)
            c = node.client
            assert c is not None
            with self.run.lock:
                self.run.ops[name] += 1
            start = time.monotonic()
            involved: list[Node] = []
            outcome = "ok"
            try:
                involved = getattr(self, f"op_{name}")(node, c, ns, tokens)
            except (kvstored.KVStoreError, KvctlFailed) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
                self.classify(name, node, c, exc, start)
                time.sleep(0.02)   # as an engine would, rather than spin while a daemon is down
            except Exception:
                self.run.finding(f"{name} on {node.name}: {traceback.format_exc()}")
            took = time.monotonic() - start
            self.history = [*self.history[-4:], f"{name} on {node.name}: {outcome} after {took:.2f} s"]
            if took > OP_BOUND_S and not self.run.near_fault([node, *involved], start, time.monotonic()):
                self.run.finding(f"{name} on {node.name} took {took:.1f} s with no fault near")

    def classify(self, name: str, node: Node, c: kvstored.Client, exc: Exception, start: float) -> None:
        text = str(exc)
        near = self.run.near_fault([node], start, time.monotonic())
        near_any = self.run.near_fault(self.run.nodes, start, time.monotonic())
        kind = None
        if isinstance(exc, kvstored.ClientClosed) and id(c) in self.run.closed:
            kind = "client closed by another thread"
        elif isinstance(exc, kvstored.NotFound) and "unknown buffers" in text and id(c) in self.run.closed:
            kind = "buffers of a client closed by another thread"
        elif isinstance(exc, KvctlFailed):
            if near and any(m in exc.line for m in ("no kvstored daemon answers", "went away", "did not answer",
                                                    "cancelled the call", "did not open a session")):
                kind = "kvctl: node down"
            elif "no namespace of model" in exc.line:
                kind = "kvctl: model not known yet"
            elif exc.args_line.startswith(("migrate", "drain")) and "failed:" in exc.line and near_any:
                kind = "kvctl: blocks failed near a fault"
            elif exc.args_line.startswith(("migrate", "drain")) and any(
                    m in exc.line for m in ("no longer held here", "before it is not held here", "tier is full")):
                kind = "kvctl: evicted meanwhile, or the receiver full"
            elif exc.args_line.startswith("flush") and ("could not" in exc.line or (
                    (node.small or near) and "still only in DRAM" in exc.line)):
                # a small node's SSD tier (1 MiB) full of blocks worth more, or being read
                kind = "kvctl flush: SSD full"
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
        elif name in ("flush", "evict", "migrate", "drain") and isinstance(exc, kvstored.NotFound) \
                and "no namespace of model" in text:
            kind = "model not known yet"   # since the (re)start, no client opened one of its namespaces
        elif name in ("save", "save_blocks") and isinstance(exc, kvstored.ResourceExhausted) \
                and "DRAM tier full" in text:
            kind = "DRAM full of held blocks"
        elif name == "flush" and isinstance(exc, kvstored.ResourceExhausted):
            kind = "flush: SSD full"
        if kind is None:
            self.run.finding(f"{name} on {node.name}: {type(exc).__name__}: {text} (near a fault of this node: "
                             f"{near}, of any node: {near_any})")
        else:
            self.run.count(kind)


class KvctlFailed(Exception):
    """kvctl exited 1 with its one line on stderr."""

    def __init__(self, args_line: str, line: str) -> None:
        super().__init__(f"kvctl {args_line}: {line}")
        self.args_line = args_line
        self.line = line


# -- faults ------------------------------------------------------------------------------------------
def controller(run: Run, stop: threading.Event, rng: random.Random, faults: int) -> None:
    """``faults`` faults, one node at a time, or now and then two at once (on two nodes)."""
    overlapping: list[threading.Thread] = []
    try:
        for _ in range(faults):
            if stop.wait(rng.uniform(0.3, 2.0)):
                return
            with run.lock:
                up = [n for n in run.nodes if n.down_since is None]
            if not up:
                continue
            node = rng.choice(up)
            sig = rng.choice([signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP])
            if rng.random() < 0.2:   # and the next fault comes while this one lasts
                t = threading.Thread(target=guarded, args=(run, node, sig, random.Random(rng.random())),
                                     name=f"fault-{node.name}", daemon=True)
                t.start()
                overlapping.append(t)
                time.sleep(0.05)   # (so that it is down before the next node is chosen)
            else:
                fault(run, node, sig, rng)
    except Exception:
        run.finding(f"injecting a fault: {traceback.format_exc()}")
    finally:
        for t in overlapping:
            t.join(60)
        run.faults_done.set()


def guarded(run: Run, node: Node, sig: int, rng: random.Random) -> None:
    try:
        fault(run, node, sig, rng)
    except Exception:
        run.finding(f"injecting a fault: {traceback.format_exc()}")


def fault(run: Run, node: Node, sig: int, rng: random.Random) -> None:
    with run.lock:
        node.down_since = time.monotonic()
    try:
        if sig == signal.SIGSTOP:   # a node that stops answering for a while, shorter or longer than the deadlines
            node.daemon.proc.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 1.5 * TIMEOUT_S))
            node.daemon.proc.send_signal(signal.SIGCONT)
        else:
            if rng.random() < 0.3:   # restarted with the other capacities: a node that shrank or grew
                resize(node, not node.small)
            began = time.monotonic()
            status = relaunch(node.daemon, sig, SIGTERM_BOUND_S)
            if sig == signal.SIGTERM and status != 0:
                run.finding(f"node {node.name} stopped with SIGTERM: exit status {status} after "
                            f"{time.monotonic() - began:.1f} s (with the restart)")
            elif sig == signal.SIGTERM and time.monotonic() - began > 10:
                run.count("a SIGTERM stop (and restart) took over 10 s")
    finally:
        with run.lock:
            assert node.down_since is not None
            node.faults.append((node.down_since, time.monotonic()))
            node.down_since = None


def resize(node: Node, small: bool) -> None:
    """The node's next start gets the small (or the roomy) tier capacities, over the same SSD directory."""
    args = node.daemon.args
    for flag, value in zip(SMALL_ARGS[::2] if small else ROOMY_ARGS[::2],
                           SMALL_ARGS[1::2] if small else ROOMY_ARGS[1::2]):
        at = len(args) - 1 - args[::-1].index(flag)   # the last one counts
        args[at + 1] = value
    node.small = small


# -- the run -----------------------------------------------------------------------------------------
def start_cluster(tmp: Path, rng: random.Random) -> list[Node]:
    names = ["a", "b", "c"][: rng.choice([2, 3])]
    small = rng.choice([None, *names])
    ports = free_ports(len(names))
    static = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, ports))
    nodes = []
    for name, port in zip(names, ports):
        d = start_daemon(tmp, *COMMON_ARGS, *(SMALL_ARGS if name == small else ROOMY_ARGS),
                         "--set", f"peers.listen=127.0.0.1:{port}", "--set", f"peers.node_id={name}",
                         "--set", f"peers.static={static}", wait=False, name=name)
        nodes.append(Node(name, d, name == small))
    for n in nodes:
        try:
            wait_serving(n.daemon.socket, n.daemon.proc)
        except BaseException:
            for m in nodes:
                m.daemon.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon {n.name} failed to start:\n{n.daemon.log()}") from None
    return nodes


def heal(run: Run) -> bool:
    """Every node up and serving; False (and a finding) when one exited unasked."""
    ok = True
    for n in run.nodes:
        if n.daemon.proc.poll() is not None:
            run.finding(f"node {n.name} exited ({n.daemon.proc.returncode}) without being stopped:\n"
                        f"{n.daemon.log()[-4000:]}")
            ok = False
        else:
            n.daemon.proc.send_signal(signal.SIGCONT)   # in case (the controller thawed it already)
    return ok


def check_unpinned(run: Run) -> None:
    """With no client left, nothing holds a block: evicting everything leaves every node empty
    (a pin that outlived its lease, a fetch or a push would keep its block for good). Evicting
    is repeated for a while: a promotion from SSD that the last lookups started (one-way, from
    the presence table, perhaps handled after their client closed) keeps its blocks until it ends."""
    def emptied(c: kvstored.Client) -> dict[str, Any]:
        c.evict()
        return c.stats()

    for n in run.nodes:
        with kvstored.Client(n.daemon.socket, timeout_s=30) as c:
            stats = settle(functools.partial(emptied, c), lambda s: not s["index_blocks"] and not any(
                t["blocks"] or t["used_bytes"] for t in s["tiers"]), timeout=10)
        if stats["index_blocks"] or any(t["blocks"] or t["used_bytes"] for t in stats["tiers"]):
            run.finding(f"node {n.name}: blocks left after evicting everything with no client: "
                        f"{stats['index_blocks']} in the index, tiers {stats['tiers']}")


def check_quiet(run: Run, when: str) -> None:
    """No leases, no clients, nothing in any log."""
    for n in run.nodes:
        with kvstored.Client(n.daemon.socket, timeout_s=30) as check:   # opens no session: stats needs none
            stats = run.final_stats[n.name] = settle(check.stats,
                                                     lambda s: s["active_leases"] == 0 and s["clients"] == 0)
        if stats["active_leases"] or stats["clients"]:
            run.finding(f"{when}, node {n.name}: {stats['active_leases']} active leases, {stats['clients']} "
                        "clients with every client closed")
        trouble = daemon_trouble(n.daemon)
        if trouble:
            run.finding(f"{when}, node {n.name}'s log:\n{trouble}")


def check_peers_up(run: Run) -> None:
    """Every node sees every other one up again (a restarted node listens on the same port)."""
    for n in run.nodes:
        with kvstored.Client(n.daemon.socket, timeout_s=30) as c:
            view = settle(lambda c=c: {p["node_id"]: p for p in c.peers()["peers"]},   # type: ignore[misc]
                          lambda v: all(p["state"] in ("up", "self") for p in v.values()), timeout=10)
        if set(view) != {m.name for m in run.nodes} or any(p["state"] not in ("up", "self") for p in view.values()):
            run.finding(f"node {n.name} does not see its peers up after the heal: {view}")


def check_drain(run: Run, node: Node) -> None:
    """With nothing else going on, drain ``node`` (not a small one: its own lookups, bringing SSD
    blocks to DRAM, may evict): every prefix it held is held afterwards, here (what could not
    move stays) or as a whole on the peer its tree went to. Asked of ``node`` with ``peers``:
    the peers' answer has no side effects (a lookup on a small peer could evict)."""
    assert not node.small
    with kvstored.Client(node.daemon.socket, timeout_s=30) as c:
        spaces = (*NAMESPACES, BUF_NS)
        before = {(ns.model, p): c.lookup(tokens, namespace=ns).blocks
                  for ns in spaces for p, tokens in enumerate(run.prompts)}
        last = list(c.migrate(drain=True))[-1]
        after = {(ns.model, p): c.lookup(tokens, namespace=ns, peers=True)
                 for ns in spaces for p, tokens in enumerate(run.prompts)}
    lost = {k: (n, after[k]) for k, n in before.items() if after[k].blocks < n}
    if lost:
        run.finding(f"drain of {node.name} ({last}) lost blocks: (model, prompt): (held before, held here "
                    f"and by the peers after) {lost}")
    run.count(f"final drain: {last['pushed_blocks']} pushed, {last['failed_blocks']} failed, "
              f"{last['dropped_blocks']} dropped")


def verify_served(run: Run) -> None:
    """With every node up: what each node reports as present it serves with the model's bytes,
    loaded and streamed from itself, and streamed from its peers."""
    w = Worker(run, 0, 0)
    small = {n.name for n in run.nodes if n.small}
    run.buffers.clear()   # of the clients closed before
    for n in run.nodes:
        n.client = kvstored.Client(n.daemon.socket, timeout_s=30)
    try:
        for n in run.nodes:
            c = n.client
            assert c is not None
            for ns in NAMESPACES:
                for tokens in run.prompts:
                    present = c.lookup(tokens, namespace=ns).blocks
                    loaded = c.load(tokens, namespace=ns)
                    w.check_rows(f"final load on {n.name}", ns, tokens, 0, list(loaded.data))
                    if loaded.blocks < present and not n.small:
                        run.finding(f"final load on {n.name}: {loaded.blocks} blocks of the {present} its "
                                    "lookup reported")
                    held = c.lookup(tokens, namespace=ns, peers=True)
                    w.op_stream(n, c, ns, tokens, final=True)
                    end = w.last_stream
                    if end is not None and end.blocks < held.blocks:
                        if n.small or set(held.per_peer) & small:
                            # no DRAM slot here, or on the peer for a block it holds on SSD only
                            # (which it then answers as not held: stop "missing")
                            run.count("final stream: short of a small node's answer")
                        else:
                            run.finding(f"final stream on {n.name}: {end} where its lookup found {held}")
            for tokens in run.prompts:
                held = c.lookup(tokens, namespace=BUF_NS, peers=True)
                w.op_stream_buffers(n, c, BUF_NS, tokens)
                end = w.last_stream
                if end is not None and end.blocks < held.blocks:
                    if n.small or set(held.per_peer) & small:
                        run.count("final stream: short of a small node's answer")
                    else:
                        run.finding(f"final stream(buffers) on {n.name}: {end} where its lookup found {held}")
    finally:
        for n in run.nodes:
            if n.client is not None:
                n.client.close()
                n.client = None


def run_seed(seed: int, tmp: Path) -> Run:
    rng = random.Random(seed)
    nodes = start_cluster(tmp, rng)
    threads = rng.randint(2, 4)
    tensors = [kvstored.shm.empty((2, threads * 2 * MAX_BLOCKS, 16, HEADS, DIM), "float16") for _ in range(LAYERS)]
    run = Run(seed, nodes, make_prompts(rng, 24, 3, MAX_BLOCKS), threads, tensors)
    began = time.monotonic()
    try:
        for n in nodes:
            n.client = kvstored.Client(n.daemon.socket, timeout_s=TIMEOUT_S)
        workers = [Worker(run, i, rng.randint(80, 160)) for i in range(run.threads)]
        threads = [threading.Thread(target=w, name=f"worker-{i}", daemon=True) for i, w in enumerate(workers)]
        stop = threading.Event()
        ctl = threading.Thread(target=controller, args=(run, stop, random.Random(seed + 7), rng.randint(2, 4)),
                               name="controller", daemon=True)
        for t in [*threads, ctl]:
            t.start()
        deadline = time.monotonic() + THREAD_BOUND_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stop.set()
        ctl.join(60)
        hung = [t for t in [*threads, ctl] if t.is_alive()]
        if hung:
            frames = sys._current_frames()
            stacks = "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
                               for t in hung if t.ident in frames)
            run.finding(f"{len(hung)} threads did not finish within {THREAD_BOUND_S:g} s:\n{stacks}")
            return run
        for n in nodes:
            if n.client is not None:
                n.client.close()
                n.client = None
        if not heal(run):
            return run
        check_quiet(run, "after the run")
        relaunch(rng.choice(nodes).daemon, signal.SIGTERM)   # what a clean restart kept is served right too
        check_peers_up(run)
        roomy = [n for n in nodes if not n.small]
        if roomy:
            check_drain(run, rng.choice(roomy))
        verify_served(run)
        check_quiet(run, "after the final check")
        check_unpinned(run)
        return run
    finally:
        run.elapsed = time.monotonic() - began
        for n in nodes:
            if n.client is not None:
                n.client.close()
            n.daemon.stop(signal.SIGKILL)
        for t in tensors:
            t.close()


def report(run: Run) -> str:
    return (f"seed {run.seed}: {len(run.nodes)} nodes (small: "
            f"{[n.name for n in run.nodes if n.small] or '-'}), {run.threads} threads, ops {dict(run.ops)}, "
            f"faults {sum(len(n.faults) for n in run.nodes)}, {run.elapsed:.1f} s, "
            f"expected errors {dict(run.expected)}, {run.checked_blocks} blocks checked "
            f"({run.peer_blocks} from peers)")


SEEDS = range(int(os.environ.get("KVSTORED_CLUSTER_RANDOM_SEEDS", "2")))


@pytest.mark.parametrize("seed", SEEDS)
def test_cluster_under_threads_and_faults(seed: int, tmp_path: Path) -> None:
    run = run_seed(seed, tmp_path)
    print(report(run))
    assert not run.findings, "\n\n".join(run.findings[:5])
    assert run.checked_blocks > 0 and run.peer_blocks > 0, "nothing was read back from a peer: the test checks little"


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
