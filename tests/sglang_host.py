"""Runs inside the SGLang test environment (.venv-sglang): SGLang's own storage factory loads
kvstored's HiCache backend, which moves pages of a host pool to and from a real daemon.

``python tests/sglang_host.py SCENARIO SOCKET`` prints one JSON object of what SGLang's calls
returned; tests/integration/test_sglang.py starts the daemon and asserts on it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE = 16          # tokens per page
LAYERS, HEADS, DIM = 2, 2, 8


class HostPool:
    """A host KV pool shaped like SGLang's MHA pool in its ``page_first`` layout: the page calls
    the storage backends use (a flat page out, a flat page in, a zero page)."""

    layout = "page_first"
    dtype = torch.bfloat16

    def __init__(self, pages: int, seed: int) -> None:
        self.page_size = PAGE
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((2, pages * PAGE, LAYERS, HEADS, DIM), generator=gen).to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index:index + PAGE]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index:index + PAGE] = data_page.reshape(2, PAGE, LAYERS, HEADS, DIM)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * PAGE * LAYERS * HEADS * DIM, dtype=self.dtype)

    def digest(self, index: int) -> str:
        return hashlib.sha256(self.get_data_page(index).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def backend(socket: str, pool: HostPool, *, chains: bool = True, mla: bool = False,
            tp_rank: int = 0) -> HiCacheStorage:
    """The backend as SGLang makes it: its factory's "dynamic" entry, then the host pool."""
    extra = {"backend_name": "kvstored", "module_path": "kvstored_client.sglang.hicache",
             "class_name": "KVStoredHiCacheStorage", "socket": socket, "reconnect_interval_s": 0.2,
             "timeout_s": 5.0}
    if chains:
        extra["interface_v1"] = 1
    config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2 if mla else 1, pp_rank=0, pp_size=1,
                                  attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                  enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="test/tiny-sglang", extra_config=extra)
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def keys(tag: str, n: int) -> list[str]:
    """Page keys chained the way SGLang's are: each names its whole prefix."""
    out, prior = [], ""
    for i in range(n):
        prior = hashlib.sha256(f"{prior}/{tag}/{i}".encode()).hexdigest()
        out.append(prior)
    return out


def indices(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def info(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def store(socket: str) -> dict[str, Any]:
    """A sequence of 12 pages stored in two calls (the second names the first as its prefix), and
    two pages whose prefix was never stored."""
    pool = HostPool(pages=16, seed=1)
    storage = backend(socket, pool)
    ks, orphan = keys("doc", 12), keys("orphan", 6)
    first = storage.batch_set_v1(ks[:8], indices(0, 8), info([]))
    second = storage.batch_set_v1(ks[8:], indices(8, 4), info(ks[:8]))
    orphans = storage.batch_set_v1(orphan[4:], indices(12, 2), info(orphan[:4]))
    return {"first": first, "second": second, "orphans": orphans,
            "digests": [pool.digest(i * PAGE) for i in range(12)]}


def fetch(socket: str) -> dict[str, Any]:
    """A fresh backend (another SGLang process) asks for what ``store`` left."""
    pool = HostPool(pages=16, seed=2)   # other bytes everywhere until loaded
    storage = backend(socket, pool)
    ks, orphan = keys("doc", 12), keys("orphan", 6)
    diverging = [*ks[:5], *keys("other", 7)]
    got = storage.batch_get_v1(ks[4:], indices(4, 8), info(ks[:4]))
    return {
        "exists_all": storage.batch_exists(ks, info([])),
        "exists_tail": storage.batch_exists(ks[8:], info(ks[:8])),
        "exists_diverging": storage.batch_exists(diverging, info([])),
        "exists_orphans": storage.batch_exists(orphan, info([])),
        "exists_unknown": storage.batch_exists(keys("never", 3), info([])),
        "got": got,
        "digests": [pool.digest(i * PAGE) for i in range(12)],
    }


def flat(socket: str) -> dict[str, Any]:
    """Without interface_v1 each page is its own chain: SGLang's single-page calls."""
    pool = HostPool(pages=8, seed=3)
    storage = backend(socket, pool, chains=False)
    ks = keys("flat", 4)
    pages = [pool.get_data_page(i * PAGE) for i in range(4)]
    set_one = storage.set(ks[0], pages[0])
    set_batch = storage.batch_set(ks[1:3], pages[1:3])
    exists = [storage.exists(k) for k in ks]
    got = storage.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
    return {"set_one": set_one, "set_batch": set_batch, "exists": exists,
            "batch_exists": storage.batch_exists(ks),
            "equal": [g is not None and bool(torch.equal(g, p)) for g, p in zip(got, pages, strict=True)],
            "missing": [g is None for g in got],
            "v1_got": storage.batch_get_v1(ks, indices(4, 4), None),
            "v1_equal": [bool(torch.equal(pool.get_data_page((4 + i) * PAGE), pages[i])) for i in range(3)]}


def down(socket: str) -> dict[str, Any]:
    """No daemon yet: SGLang's calls miss without raising. Then (a line on stdin: the test
    started one) the backend connects again by itself and stores."""
    pool = HostPool(pages=8, seed=4)
    storage = backend(socket, pool)
    ks = keys("down", 4)
    before = {"exists": storage.batch_exists(ks, info([])), "set": storage.batch_set_v1(ks, indices(0, 4), info([])),
              "get": storage.batch_get_v1(ks, indices(4, 4), info([])), "single": storage.exists(ks[0])}
    print(json.dumps({"before": before}), flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 30
    stored = storage.batch_set_v1(ks, indices(0, 4), info([]))
    while not all(stored) and time.monotonic() < deadline:
        time.sleep(0.1)
        stored = storage.batch_set_v1(ks, indices(0, 4), info([]))
    return {"after_set": stored, "after_exists": storage.batch_exists(ks, info([]))}


def replica(socket: str) -> dict[str, Any]:
    """MLA on two tensor-parallel ranks: rank 1 holds the same KV as rank 0 and never writes."""
    pool = HostPool(pages=4, seed=5)
    ks = keys("mla", 2)
    rank1 = backend(socket, pool, mla=True, tp_rank=1).batch_set_v1(ks, indices(0, 2), info([]))
    rank0 = backend(socket, pool, mla=True, tp_rank=0)
    seen_before = rank0.batch_exists(ks, info([]))
    written = rank0.batch_set_v1(ks, indices(0, 2), info([]))
    return {"rank1_set": rank1, "seen_before": seen_before, "rank0_set": written,
            "seen_after": rank0.batch_exists(ks, info([]))}


def environment(socket: str) -> dict[str, Any]:
    """What of the daemon's dependencies this environment has (an engine needs none)."""
    import importlib.util
    return {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "lmdb", "kvstored_client")}


if __name__ == "__main__":
    scenario, sock = sys.argv[1], sys.argv[2]
    print(json.dumps({"result": globals()[scenario](sock)}), flush=True)
