"""kvstored as an SGLang HiCache storage backend (the L3 tier below SGLang's host memory).

SGLang loads it as a "dynamic" backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "kvstored", "module_path": "kvstored_client.sglang.hicache",
        "class_name": "KVStoredHiCacheStorage", "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": true, "socket": "/run/kvstored/kvstored.sock"}'

With ``interface_v1`` and ``hicache_storage_pass_prefix_keys`` a batch of pages is one chain and
one round trip; without them each page is its own chain and costs a round trip. Pages are copied
between SGLang's host pool and the daemon's arena (one gather or scatter per batch). A daemon
that is down or restarting costs misses, never an error: calls answer "not stored" and the
backend connects again at most every ``reconnect_interval_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstored_client.client import Client
from kvstored_client.contract.errors import DaemonNotRunning, KVStoreError, NotFound
from kvstored_client.errors import ClientClosed
from kvstored_client.sglang.pages import PageChain, PoolShape, block_key

logger = logging.getLogger(__name__)

T = TypeVar("T")


class KVStoredHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` over the local kvstored daemon (see the module's docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self._config = storage_config
        self._socket: str | None = extra.get("socket") or None
        self._chains = bool(extra.get("interface_v1", 0))
        self._retry_s = float(extra.get("reconnect_interval_s", 1.0))
        self._timeout_s = float(extra.get("timeout_s", 10.0))
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._next_connect = 0.0
        self._shape: PoolShape | None = None
        self._page_tokens = 0
        self._page_bytes = 0

    # -- SGLang's hooks ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        cfg = self._config
        self._shape = PoolShape(
            model=cfg.model_name or "sglang", kv_dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            page_size=int(mem_pool_host.page_size), layout=str(mem_pool_host.layout),
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
            replicated=bool(cfg.is_mla_model))
        page = mem_pool_host.get_dummy_flat_data_page()
        self._page_tokens = self._shape.page_size
        self._page_bytes = page.numel() * page.element_size()

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` are stored."""
        prefix = self._prefix(extra_info)
        if prefix is None:
            return next((i for i, key in enumerate(keys) if not self.exists(key)), len(keys))
        chain = PageChain.of(keys, prefix)
        return chain.own(self._do(lambda c: c.lookup(hashes=chain.hashes).blocks, 0))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices`` (a page's tokens each)."""
        rows = np.empty((len(keys), self._page_bytes), np.uint8)
        prefix = self._prefix(extra_info)
        if prefix is None:
            got = next((i for i, key in enumerate(keys) if not self._load_page(key, rows[i:i + 1])), len(keys))
        else:
            chain = PageChain.of(keys, prefix)
            got = chain.own(self._do(lambda c: c.load(hashes=chain.hashes, out=rows, start=chain.start).blocks, 0))
        self._scatter(rows[:got], host_indices)
        return [i < got for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``."""
        if not self._config.is_storage_writer:
            return [True] * len(keys)   # a replica: another rank writes these pages
        rows = self._gather(host_indices, len(keys))
        prefix = self._prefix(extra_info)
        if prefix is None:
            return [self._save_page(key, rows[i:i + 1]) for i, key in enumerate(keys)]
        chain = PageChain.of(keys, prefix)
        saved = self._do(lambda c: c.save(None, rows, hashes=chain.hashes, start=chain.start), None)
        stored = 0 if saved is None else chain.own(saved.present + saved.stored)
        return [i < stored for i in range(len(keys))]

    def exists(self, key: str) -> bool:
        return bool(self._do(lambda c: c.lookup(hashes=[block_key(key)]).blocks, 0))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        page = target_location if target_location is not None else self.mem_pool_host.get_dummy_flat_data_page()
        row = np.empty((1, self._page_bytes), np.uint8)
        if not self._load_page(key, row):
            return None
        page.view(-1).copy_(torch.from_numpy(row[0]).view(page.dtype))
        return page

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return not self._config.is_storage_writer or self._save_page(key, _byte_rows(value))

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self.set(key, value) for key, value in zip(keys, values, strict=True))

    def clear(self) -> None:
        """Drop this model's blocks from the daemon (leased ones stay)."""
        model = self._shape.model if self._shape else (self._config.model_name or "sglang")

        def evict(client: Client) -> int:
            try:
                return client.evict(model)
            except NotFound:   # nothing of this model was ever stored
                return 0
        self._do(evict, 0)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- the daemon -------------------------------------------------------------------------------
    def _prefix(self, extra_info: HiCacheStorageExtraInfo | None) -> Sequence[str] | None:
        if not self._chains or extra_info is None:
            return None
        prefix: Sequence[str] | None = extra_info.prefix_keys
        return prefix

    def _load_page(self, key: str, row: Any) -> bool:
        return bool(self._do(lambda c: c.load(hashes=[block_key(key)], out=row).blocks, 0))

    def _save_page(self, key: str, row: Any) -> bool:
        saved = self._do(lambda c: c.save(None, row, hashes=[block_key(key)]), None)
        return saved is not None and saved.present + saved.stored == 1

    def _do(self, call: Callable[[Client], T], failed: T) -> T:
        """``call`` on the daemon's client; ``failed`` when the daemon is down or refuses."""
        client = self._connected()
        if client is None:
            return failed
        try:
            return call(client)
        except KVStoreError as exc:
            logger.warning("kvstored: %s (%s); treated as not stored", exc, exc.reason)
            if isinstance(exc, DaemonNotRunning | ClientClosed):
                self._forget(client)
            return failed

    def _connected(self) -> Client | None:
        with self._lock:
            if self._client is not None:
                return self._client
            if self._shape is None or time.monotonic() < self._next_connect:
                return None
            try:
                self._client = Client(self._socket, namespace=self._shape.namespace(), timeout_s=self._timeout_s,
                                      client_name="kvstored-sglang")
            except KVStoreError as exc:
                self._next_connect = time.monotonic() + self._retry_s
                logger.warning("kvstored: not connected (%s); pages miss until it answers", exc)
            return self._client

    def _forget(self, client: Client) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
                self._next_connect = time.monotonic() + self._retry_s
        client.close()

    # -- the host pool ----------------------------------------------------------------------------
    def _gather(self, host_indices: torch.Tensor, pages: int) -> np.ndarray:
        pool, size = self.mem_pool_host, self._page_tokens
        rows = np.empty((pages, self._page_bytes), np.uint8)
        for i in range(pages):
            rows[i] = _byte_rows(pool.get_data_page(int(host_indices[i * size]), flat=True))[0]
        return rows

    def _scatter(self, rows: np.ndarray, host_indices: torch.Tensor) -> None:
        pool, size = self.mem_pool_host, self._page_tokens
        for i in range(rows.shape[0]):
            pool.set_from_flat_data_page(int(host_indices[i * size]), torch.from_numpy(rows[i]).view(pool.dtype))


def _byte_rows(page: torch.Tensor) -> torch.Tensor:
    """A page tensor as one row of bytes (a view when it is contiguous)."""
    return page.contiguous().view(torch.uint8).reshape(1, -1)
