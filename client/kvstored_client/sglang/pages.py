"""SGLang's HiCache pages as kvstored blocks: their keys, chains and namespace (no SGLang import).

SGLang names a page by a string that already covers its whole prefix (a hash chained over the
pages before it). A call that says which pages precede its own (``prefix_keys``) is stored as one
chain from the sequence's start, so the daemon's prefix index and eviction see the sequence; a call
that does not is stored page by page, each page a chain of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvstored_client.contract.namespace import Namespace

# Keys are SGLang's, not derived by kvstored from tokens: a seed of their own keeps them apart
# from every chain the SDK or vLLM hashes.
HASH_SEED = "sglang-hicache-page"


def block_key(page_key: str) -> bytes:
    """The 32-byte block key of one SGLang page key (any string SGLang uses)."""
    return hashlib.sha256(page_key.encode()).digest()


@dataclass(frozen=True, slots=True)
class PageChain:
    """A call's pages as one chain: ``hashes`` from the sequence's start, the call's own pages
    from block ``start`` on."""

    hashes: tuple[bytes, ...]
    start: int

    @classmethod
    def of(cls, keys: Sequence[str], prefix_keys: Sequence[str]) -> PageChain:
        return cls(tuple(block_key(k) for k in (*prefix_keys, *keys)), len(prefix_keys))

    def own(self, cached_blocks: int) -> int:
        """How many of the call's own pages lie inside a cached prefix of ``cached_blocks``."""
        return min(max(cached_blocks - self.start, 0), len(self.hashes) - self.start)


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What of a host pool's geometry decides whether two pages' bytes are interchangeable."""

    model: str
    kv_dtype: str
    page_size: int
    layout: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    replicated: bool   # MLA: every tensor-parallel rank holds the same KV

    def namespace(self) -> Namespace:
        return Namespace(model=self.model, kv_dtype=self.kv_dtype, block_size=self.page_size,
                         layout=f"sglang:{self.layout}:pp{self.pp_rank}/{self.pp_size}",
                         tp_rank=0 if self.replicated else self.tp_rank,
                         tp_size=0 if self.replicated else self.tp_size,
                         hash_algo="sha256_cbor", hash_seed=HASH_SEED)
