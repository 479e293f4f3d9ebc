"""Workload 1: put/get of KV blocks, one driver for every contender.

A contender stores rows of a source array under keys and loads them back into rows of a
destination array. The driver walks through a working set of distinct rows (>= 1 GiB outside
quick mode) so that no cache flatters anyone, times every call and every pass, and checks a few
loaded rows byte for byte (outside the timing). Keys are new in every run (kvstored and Mooncake
keep the first value of a key), so each put really stores.

Run as a worker: ``python -m tools.bench.putget --impl NAME ... --out result.json``. Contenders
implement :class:`tools.bench.contender.Impl`; those that need peer packages live in
:mod:`tools.bench.peer_stores` and run from the bench venv.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench import peer_stores
from tools.bench.common import MiB, worker_output
from tools.bench.contender import Impl


def fill_pattern(src: np.ndarray) -> None:
    """Row i: its index in the first 8 bytes, then a byte that depends on i."""
    n = src.shape[0]
    for i in range(n):
        src[i].fill((i * 37 + 11) % 251)
    src[:, :8] = np.arange(n, dtype="<u8").view(np.uint8).reshape(n, 8)


class ShmFile:
    """A pre-faulted shared-memory file mapped read-write, like the daemon's arena."""

    def __init__(self, nbytes: int) -> None:
        shm_dir = os.environ.get("KVSTORED_SHM_DIR", "/dev/shm")
        self.path = Path(shm_dir) / f"kvbench-{os.getpid()}-{os.urandom(4).hex()}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path.unlink()  # the mapping keeps it alive; nothing is left behind
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.array[:: mmap.PAGESIZE] = 0

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:
            pass


class Memcpy(Impl):
    """The limit: per-block numpy copies heap -> shm (put) and shm -> heap (get), warm buffers."""

    name = "memcpy"

    def prepare(self, block_bytes: int, n_blocks: int) -> None:
        super().prepare(block_bytes, n_blocks)
        self._shm = ShmFile(block_bytes * n_blocks)
        self.store = self._shm.array.reshape(n_blocks, block_bytes)

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        store, src = self.store, self.src
        for i in range(start, start + count):
            store[i] = src[i]

    def get(self, keys: list[bytes], start: int, count: int) -> int:
        store, dst = self.store, self.dst
        for i in range(start, start + count):
            dst[i] = store[i]
        return count

    def finish(self) -> None:
        self.store = None  # type: ignore[assignment]
        self._shm.close()
        super().finish()


class KvstoredArena(Impl):
    """kvstored SDK, direct arena path: ``save(hashes=..., kv=rows)`` / ``load(hashes=..., out=rows)``."""

    name = "kvstored save/load"

    def __init__(self, socket: str) -> None:
        import kvstored

        self._kvstored = kvstored
        self.client = kvstored.Client(socket)
        self.short = 0

    def prepare(self, block_bytes: int, n_blocks: int) -> None:
        super().prepare(block_bytes, n_blocks)
        self.ns = self._kvstored.Namespace(model=f"bench-arena-{block_bytes}")

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        r = self.client.save(None, self.src[start: start + count], hashes=keys, namespace=self.ns)
        self.short += count - r.present - r.stored

    def get(self, keys: list[bytes], start: int, count: int) -> int:
        return self.client.load(hashes=keys, out=self.dst[start: start + count], namespace=self.ns).blocks

    def close(self) -> None:
        self.client.close()


class KvstoredWriteBehind(KvstoredArena):
    """The arena path with ``save(wait=False)``: a put returns once its Commit is sent; the put
    pass ends with ``wait_saves`` (timed), so the daemon's answers to every put are in."""

    name = "kvstored save(wait=False)/load"

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        r = self.client.save(None, self.src[start: start + count], hashes=keys, namespace=self.ns, wait=False)
        self.short += count - r.present - r.stored

    def end_puts(self) -> None:
        self.client.wait_saves()
        self.short += self.client.lost_saved_blocks - self._lost   # sent, then not stored after all
        self._lost = self.client.lost_saved_blocks

    _lost = 0


class KvstoredRegistered(Impl):
    """kvstored SDK, engine path: registered shm buffers, ``save_blocks`` / ``load_blocks``.

    One registered tensor of 2 x n blocks: the first half are the sources, the second half the
    destinations (an engine's paged KV buffer); the daemon does the copies.
    """

    name = "kvstored save_blocks/load_blocks"

    def __init__(self, socket: str) -> None:
        import kvstored

        self._kvstored = kvstored
        self.client = kvstored.Client(socket)
        self.short = 0

    def prepare(self, block_bytes: int, n_blocks: int) -> None:
        ns = self._kvstored.Namespace(model=f"bench-reg-{block_bytes}")
        self.n = n_blocks
        self.tensor = self._kvstored.shm.empty((2 * n_blocks, block_bytes // 2), "float16")
        whole = self.tensor.bytes.reshape(2 * n_blocks, block_bytes)
        whole.fill(0)  # fault the engine buffer in, as an engine's would be
        self.src, self.dst = whole[:n_blocks], whole[n_blocks:]
        self.buffers = self.client.register_buffers([self.tensor.numpy()], block_dim=0, namespace=ns)

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        r = self.client.save_blocks(self.buffers, range(start, start + count), hashes=keys)
        self.short += count - r.present - r.stored

    def get(self, keys: list[bytes], start: int, count: int) -> int:
        n = self.n
        return self.client.load_blocks(self.buffers, range(n + start, n + start + count), hashes=keys).blocks

    def finish(self) -> None:
        self.client.unregister_buffers(self.buffers)
        self.src = self.dst = None  # type: ignore[assignment]
        self.tensor.close()

    def close(self) -> None:
        self.client.close()


def make_keys(tag: str, block_bytes: int, run: int, n: int) -> list[bytes]:
    """n distinct 32-byte keys (like sha256 block hashes) for one run."""
    seed = hashlib.sha256(f"{tag}/{block_bytes}/{run}/{os.getpid()}".encode()).digest()
    return [hashlib.sha256(seed + i.to_bytes(4, "little")).digest() for i in range(n)]


def run_putget(impl: Impl, sizes: list[int], batches: list[int], ws_bytes: int, runs: int,
               max_ops: int, deadline_s: float) -> list[dict[str, Any]]:
    """For each block size and batch: a warm-up run, then ``runs`` timed put passes and get passes.

    A pass is up to ``max_ops`` calls over consecutive rows, continuing where the last pass
    stopped, so the runs together cycle through the whole working set.
    """
    out: list[dict[str, Any]] = []
    stop_at = time.monotonic() + deadline_s
    for block_bytes in sizes:
        n_blocks = max(max(batches), ws_bytes // block_bytes)
        n_blocks -= n_blocks % max(batches)
        impl.prepare(block_bytes, n_blocks)
        fill_pattern(impl.src)
        rng = np.random.default_rng(block_bytes)
        try:
            for batch in batches:
                ops = max(1, min(max_ops, n_blocks // batch))
                rec: dict[str, dict[str, list[float]]] = {
                    op: {"gbps": [], "op_us": []} for op in ("put", "get")}
                cursor = 0
                old_keys: list[list[bytes]] = []
                short_get = 0
                verified = wrong = 0
                for run in range(runs + 1):  # run 0 warms up
                    if time.monotonic() > stop_at:
                        raise TimeoutError(f"deadline of {deadline_s:g} s reached")
                    keys = make_keys(impl.name, block_bytes, run * 1000 + batch, ops * batch)
                    starts = [(cursor + k * batch) % n_blocks for k in range(ops)]
                    cursor = (cursor + ops * batch) % n_blocks
                    for op in ("put", "get"):
                        lat = []
                        got = 0
                        t0 = time.perf_counter()
                        for k, start in enumerate(starts):
                            kk = keys[k * batch: (k + 1) * batch]
                            a = time.perf_counter()
                            if op == "put":
                                impl.put(kk, start, batch)
                            else:
                                got += impl.get(kk, start, batch)
                            lat.append(time.perf_counter() - a)
                        if op == "put":
                            impl.end_puts()
                        elapsed = time.perf_counter() - t0
                        if op == "get":
                            short_get += ops * batch - got if run else 0
                            ok, bad = _verify(impl, starts, batch, rng)
                            verified += ok
                            wrong += bad
                        if run:
                            # bytes that moved: a get that missed copied nothing and must not count
                            moved = got if op == "get" else ops * batch
                            rec[op]["gbps"].append(moved * block_bytes / elapsed / 1e9)
                            rec[op]["op_us"].append(float(np.median(lat)) * 1e6)
                    old_keys.append(keys)
                    if len(old_keys) > 2:
                        impl.drop(old_keys.pop(0))
                for keys in old_keys:
                    impl.drop(keys)
                for op in ("put", "get"):
                    out.append({"op": op, "block_bytes": block_bytes, "batch": batch, "runs": runs,
                                "ops_per_pass": ops, "working_set_bytes": n_blocks * block_bytes,
                                "gbps": rec[op]["gbps"], "op_us": rec[op]["op_us"],
                                "short_blocks": short_get if op == "get" else getattr(impl, "short", 0),
                                "verified_rows": verified, "wrong_rows": wrong})
                if hasattr(impl, "short"):
                    impl.short = 0
        finally:
            impl.finish()
    return out


def _verify(impl: Impl, starts: list[int], batch: int, rng: np.random.Generator) -> tuple[int, int]:
    """Compare two loaded rows with their sources, then spoil them so a later miss cannot pass.

    Returns (rows checked, rows that differ)."""
    checked = bad = 0
    rows = {int(starts[int(rng.integers(len(starts)))] + rng.integers(batch)) for _ in range(2)}
    for row in rows:
        bad += not np.array_equal(impl.dst[row], impl.src[row])
        checked += 1
    for row in rows:
        impl.dst[row, :64] = 0xEE
    return checked, bad


IMPLS: dict[str, Callable[[argparse.Namespace], Impl]] = {
    "memcpy": lambda a: Memcpy(),
    "kvstored-arena": lambda a: KvstoredArena(a.socket),
    "kvstored-behind": lambda a: KvstoredWriteBehind(a.socket),
    "kvstored-registered": lambda a: KvstoredRegistered(a.socket),
    "redis": lambda a: peer_stores.Redis(a.port),
    "mooncake": lambda a: peer_stores.Mooncake(a.port),
    "lmcache": lambda a: peer_stores.LMCache(),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", required=True)
    p.add_argument("--socket", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--sizes", default=f"{2 * MiB},{256 << 10}")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--ws-bytes", type=int, default=1 << 30)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-ops", type=int, default=1024)
    p.add_argument("--deadline-s", type=float, default=600)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with worker_output(a.out) as result:
        if a.impl not in IMPLS:
            raise SystemExit(f"unknown contender {a.impl!r}")
        impl = IMPLS[a.impl](a)
        result["impl"] = impl.name
        try:
            result["results"] = run_putget(impl, [int(s) for s in a.sizes.split(",")],
                                           [int(b) for b in a.batches.split(",")], a.ws_bytes, a.runs,
                                           a.max_ops, a.deadline_s)
            result["notes"] = getattr(impl, "notes", "")
        finally:
            impl.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
