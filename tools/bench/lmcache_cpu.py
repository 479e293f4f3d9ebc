"""LMCache's CPU path as a workload-1 contender (bench venv only: imports torch and lmcache).

LMCache keys KV by chunks of tokens. One benchmark block is one chunk of ``chunk`` tokens whose
KV is shaped (1 layer, K/V, chunk, heads, 128) in float16 so that it has ``block_bytes``; the
block's key becomes the chunk's tokens. A small connector copies between our rows and LMCache's
memory objects (LMCache ships only GPU connectors and a no-op mock).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

HEAD = 128


def describe() -> str:
    import lmcache

    return f"lmcache {getattr(lmcache, '__version__', '?')}, torch {torch.__version__}, local CPU backend"


def _make_connector(kv_shape: tuple[int, ...], chunk: int) -> Any:
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    class CpuRowsConnector(MockGPUConnector):
        """Copies chunk i of a request to/from row ``row0 + i`` of a uint8 (rows, bytes) array."""

        def batched_from_gpu(self, memory_objs, starts, ends, **kw):  # type: ignore[no-untyped-def]
            rows, row0 = kw["rows"], kw["row0"]
            for obj, start in zip(memory_objs, starts):
                flat = obj.tensor.view(torch.uint8).reshape(-1)
                flat.copy_(rows[row0 + start // chunk])

        def batched_to_gpu(self, memory_objs, starts, ends, **kw):  # type: ignore[no-untyped-def]
            rows, row0 = kw["rows"], kw["row0"]
            for obj, start in zip(memory_objs, starts):
                rows[row0 + start // chunk].copy_(obj.tensor.view(torch.uint8).reshape(-1))

    return CpuRowsConnector(kv_shape)


class CpuEngine:
    def __init__(self, block_bytes: int, n_blocks: int, chunk: int, src: np.ndarray, dst: np.ndarray) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        heads = block_bytes // (2 * chunk * HEAD * 2)
        if heads * 2 * chunk * HEAD * 2 != block_bytes:
            raise ValueError(f"{block_bytes} B is not a whole number of heads of {chunk} tokens")
        self.chunk = chunk
        kv_shape = (1, 2, chunk, heads, HEAD)
        # Room for three runs of keys (the driver keeps two runs alive), at least 1 GiB.
        cpu_gb = max(1.0, 3.2 * n_blocks * block_bytes / 2**30)
        config = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=True,
                                                   max_local_cpu_size=cpu_gb, save_unfull_chunk=False)
        metadata = LMCacheMetadata(model_name=f"bench-{block_bytes}", world_size=1, local_world_size=1,
                                   worker_id=0, local_worker_id=0, kv_dtype=torch.float16,
                                   kv_shape=kv_shape, chunk_size=chunk)
        self._builder = LMCacheEngineBuilder
        self._id = f"kvbench-{block_bytes}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self._id, config, metadata, _make_connector(kv_shape, chunk), lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        self.src = torch.from_numpy(src)
        self.dst = torch.from_numpy(dst)

    def _tokens(self, keys: list[bytes]) -> torch.Tensor:
        reps = self.chunk // 16
        per_key = [np.tile(np.frombuffer(k, dtype=np.uint16), reps) for k in keys]
        return torch.from_numpy(np.concatenate(per_key).astype(np.int64))

    def store(self, keys: list[bytes], start: int, count: int) -> None:
        self.engine.store(self._tokens(keys), rows=self.src, row0=start)

    def retrieve(self, keys: list[bytes], start: int, count: int) -> int:
        mask = self.engine.retrieve(self._tokens(keys), rows=self.dst, row0=start)
        return int(mask.sum().item()) // self.chunk

    def close(self) -> None:
        self._builder.destroy(self._id)
