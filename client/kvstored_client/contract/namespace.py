"""Namespaces: what must be equal for two blocks to be interchangeable."""

from __future__ import annotations

import hashlib
import operator
from dataclasses import asdict, dataclass

from kvstored_client.contract.hashing import ALGORITHMS, DEFAULT_ALGO, DEFAULT_SEED


@dataclass(frozen=True, slots=True)
class Namespace:
    """Model id and revision, KV dtype, tokens per block, layout signature, tensor-parallel shard
    (``tp_size=0`` means one full shard, e.g. MLA), hash algorithm and seed, and the payload bytes
    of one block (0: fixed by the first save)."""

    model: str = "default"
    revision: str = ""
    kv_dtype: str = ""
    block_size: int = 16
    layout: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    hash_algo: str = DEFAULT_ALGO
    hash_seed: str = DEFAULT_SEED
    block_bytes: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        for name in _TEXT_FIELDS:
            if not isinstance(getattr(self, name), str):
                # (the checks below met it as "argument of type 'int' is not iterable", or not at all)
                raise ValueError(f"namespace.{name} must be a str, got {getattr(self, name)!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            try:
                operator.index(value)
            except TypeError:
                raise ValueError(f"namespace.{name} must be an int, got {value!r}") from None
            if isinstance(value, bool):
                raise ValueError(f"namespace.{name} must be an int, got {value!r}")
        if not self.model:
            raise ValueError("namespace.model must not be empty")
        if not 1 <= self.block_size <= 4096:
            raise ValueError(f"namespace.block_size must be in 1..4096, got {self.block_size}")
        if self.hash_algo not in ALGORITHMS:
            raise ValueError(f"namespace.hash_algo must be one of {', '.join(ALGORITHMS)}, got {self.hash_algo!r}")
        if self.tp_size < 0 or (self.tp_size > 0 and not 0 <= self.tp_rank < self.tp_size) \
                or (self.tp_size == 0 and self.tp_rank != 0):
            raise ValueError(f"namespace.tp_rank {self.tp_rank} is not a rank of tp_size {self.tp_size}")
        if self.block_bytes < 0:
            raise ValueError("namespace.block_bytes must not be negative")
        for name in _TEXT_FIELDS:
            # identity() joins the fields with this character: a field holding it could make two
            # different namespaces share an id (and their blocks)
            value = getattr(self, name)
            if "\x1f" in value:
                raise ValueError(f"namespace.{name} must not contain the control character \\x1f, got {value!r}")

    def identity(self) -> int:
        """A stable 63-bit id from every field except ``block_bytes`` (which may be fixed later)."""
        fields = asdict(self)
        fields.pop("block_bytes")
        text = "\x1f".join(f"{k}={v}" for k, v in sorted(fields.items()))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1

    @property
    def digest_size(self) -> int:
        return 32 if self.hash_algo == "sha256_cbor" else 16


_TEXT_FIELDS = ("model", "revision", "kv_dtype", "layout", "hash_algo", "hash_seed")
_INT_FIELDS = ("block_size", "tp_rank", "tp_size", "block_bytes")
