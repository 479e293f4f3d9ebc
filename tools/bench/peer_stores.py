"""Peer contenders for workload 1, run from the bench venv (``.bench/venv``), never the product's;
the driver is :mod:`tools.bench.putget`, which names them by ``--impl``.

* Redis: ``redis`` + ``hiredis`` client against a ``redis-server`` the harness started.
* Mooncake Store: a client process (no segment of its own) against a master and a holder process
  that mounts the memory, so every byte crosses processes over its TCP transport; zero-copy
  ``put_from`` / ``get_into`` on registered buffers.
* LMCache: its CPU path in-process (``LMCacheEngine`` with a small CPU connector that copies
  between our rows and LMCache's memory objects); one block = one LMCache chunk.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from tools.bench.contender import Impl

if TYPE_CHECKING:   # it imports torch and lmcache: only in the bench venv, only for LMCache
    from tools.bench.lmcache_cpu import CpuEngine

MOONCAKE_SEGMENT_ENV = "KVBENCH_MOONCAKE_SEGMENT"


class Redis(Impl):
    """SET/GET (pipelined SETs and MGET for batches); GET results are copied into the rows."""

    name = "Redis"

    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port, socket_keepalive=True)
        self.r.ping()
        parser = type(self.r.connection_pool.get_connection("PING")._parser).__name__
        self.notes = f"redis-py {redis.__version__}, parser {parser}"

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        src = self.src
        if count == 1:
            self.r.set(keys[0], memoryview(src[start]))
            return
        pipe = self.r.pipeline(transaction=False)
        for i, k in enumerate(keys):
            pipe.set(k, memoryview(src[start + i]))
        pipe.execute()

    def get(self, keys: list[bytes], start: int, count: int) -> int:
        dst = self.dst
        values = [self.r.get(keys[0])] if count == 1 else self.r.mget(keys)
        got = 0
        for i, v in enumerate(values):
            if v is not None:
                dst[start + i] = np.frombuffer(v, dtype=np.uint8)
                got += 1
        return got

    def drop(self, keys: list[bytes]) -> None:
        for k in range(0, len(keys), 512):
            self.r.delete(*keys[k: k + 512])

    def close(self) -> None:
        self.r.close()


class Mooncake(Impl):
    """Mooncake Store client with zero-copy batch_put_from / batch_get_into on registered rows."""

    name = "Mooncake Store"

    def __init__(self, master_port: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        segment = int(os.environ.get(MOONCAKE_SEGMENT_ENV, "0"))
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 << 20, "tcp", "",
                              f"127.0.0.1:{master_port}")
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self.notes = f"client segment {segment >> 20} MiB; data held by a separate holder process"

    def prepare(self, block_bytes: int, n_blocks: int) -> None:
        super().prepare(block_bytes, n_blocks)
        self.bb = block_bytes
        for arr in (self.src, self.dst):
            rc = self.store.register_buffer(arr.ctypes.data, arr.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        self._touch_segment(n_blocks)

    def _touch_segment(self, n_blocks: int) -> None:
        """Write the holder's segment once before timing (kvstored's arena is pre-faulted at start;
        the holder's pages were first touched inside timed put passes 1-2: 0.8-1.0 GB/s, then 1.6-1.9).
        The harness sizes the segment at 4 working sets plus slack; fill 4 working sets, then remove."""
        bb, base, batch = self.bb, self.src.ctypes.data, 32
        keys = []
        for rep in range(4):
            for start in range(0, n_blocks - batch + 1, batch):
                kk = [f"touch-{rep}-{start + i}" for i in range(batch)]
                rcs = self.store.batch_put_from(kk, [base + (start + i) * bb for i in range(batch)], [bb] * batch)
                keys += [k for k, rc in zip(kk, rcs) if rc == 0]
        time.sleep(0.6)
        for k in keys:
            self.store.remove(k)

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        bb, base = self.bb, self.src.ctypes.data
        if count == 1:
            rc = self.store.put_from(keys[0].hex(), base + start * bb, bb)
            if rc != 0:
                raise RuntimeError(f"put_from returned {rc}")
            return
        rcs = self.store.batch_put_from([k.hex() for k in keys],
                                        [base + (start + i) * bb for i in range(count)], [bb] * count)
        bad = [r for r in rcs if r != 0]
        if bad:
            raise RuntimeError(f"batch_put_from returned {bad[0]} for {len(bad)} keys")

    def get(self, keys: list[bytes], start: int, count: int) -> int:
        bb, base = self.bb, self.dst.ctypes.data
        if count == 1:
            return int(self.store.get_into(keys[0].hex(), base + start * bb, bb) == bb)
        got = self.store.batch_get_into([k.hex() for k in keys],
                                        [base + (start + i) * bb for i in range(count)], [bb] * count)
        return sum(1 for g in got if g == bb)

    def drop(self, keys: list[bytes]) -> None:
        """Remove old keys; a key read lately is leased, so what fails is retried on the next call."""
        self._pending = getattr(self, "_pending", []) + [k.hex() for k in keys]
        left = []
        for key in self._pending:
            try:
                if self.store.remove(key) != 0:
                    left.append(key)
            except Exception:
                left.append(key)
        self._pending = left

    def finish(self) -> None:
        for arr in (self.src, self.dst):
            self.store.unregister_buffer(arr.ctypes.data)
        time.sleep(0.6)  # past the master's read lease (--default_kv_lease_ttl=500)
        self.drop([])
        if self._pending:
            self.store.remove_all()
            self._pending = []
        super().finish()

    def close(self) -> None:
        self.store.close()


def mooncake_holder(master_port: int, segment_bytes: int, seconds: float) -> None:
    """A process that mounts ``segment_bytes`` of memory into the store and waits (bounded)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "",
                     f"127.0.0.1:{master_port}")
    if rc != 0:
        raise SystemExit(f"holder setup returned {rc}")
    print("HOLDER READY", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
    store.close()


class LMCache(Impl):
    """LMCache's CPU path in-process: one block is one chunk of ``CHUNK`` tokens of KV."""

    name = "LMCache (CPU, in-process)"
    CHUNK = 256

    def __init__(self) -> None:
        from tools.bench import lmcache_cpu

        self._mod = lmcache_cpu
        self.engine: CpuEngine | None = None
        self.notes = lmcache_cpu.describe()

    def prepare(self, block_bytes: int, n_blocks: int) -> None:
        super().prepare(block_bytes, n_blocks)
        self.engine = self._mod.CpuEngine(block_bytes, n_blocks, self.CHUNK, self.src, self.dst)

    def put(self, keys: list[bytes], start: int, count: int) -> None:
        assert self.engine is not None   # made by prepare()
        self.engine.store(keys, start, count)

    def get(self, keys: list[bytes], start: int, count: int) -> int:
        assert self.engine is not None
        return self.engine.retrieve(keys, start, count)

    def finish(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().finish()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="helper processes for the peer contenders (the Mooncake holder)")
    p.add_argument("role", choices=["mooncake-holder"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--segment-bytes", type=int, required=True)
    p.add_argument("--seconds", type=float, default=1800)
    a = p.parse_args(argv)
    mooncake_holder(a.port, a.segment_bytes, a.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
