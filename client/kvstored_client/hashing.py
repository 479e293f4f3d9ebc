"""Chained block hashes: the keys of kvstored, bit-compatible with vLLM's ``sha256_cbor``.

``h_i = H(cbor([h_{i-1} or NONE_HASH, [t_0..t_{B-1}], extras_i]))`` with canonical CBOR and
``NONE_HASH = H(cbor(str(seed)))``. Only whole blocks are hashed: a partial tail is ignored.
The token array is encoded once for the whole prompt with numpy, because calling cbor2 per block
costs several times the hash itself; cbor2 encodes the parent, the extras and the seed, and the
tests check the fast path against cbor2 byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import numpy as np
import xxhash

ALGORITHMS = ("sha256_cbor", "xxh3_128")
DEFAULT_ALGO = "sha256_cbor"
DEFAULT_SEED = "0"

Extras = tuple[Any, ...] | None


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256_cbor":
        return _sha256_digest
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown hash algorithm {algo!r}; expected one of {', '.join(ALGORITHMS)}")


def none_hash(seed: str = DEFAULT_SEED, algo: str = DEFAULT_ALGO) -> bytes:
    """The parent hash of block 0: ``H(cbor(str(seed)))``."""
    return _digest_fn(algo)(cbor2.dumps(str(seed), canonical=True))


_CBOR_UINT_HEAD = np.array([0, 0, 0x18, 0x19, 0, 0x1A], dtype=np.uint32)


def _encode_uints(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """CBOR-encode each token as an unsigned int; returns the bytes and each token's end offset."""
    t = tokens.astype(np.uint64, copy=False)
    if t.size and int(t.max()) >= 1 << 32:
        raise ValueError("token ids must be below 2**32")
    t32 = t.astype(np.uint32)
    width = np.ones(t32.size, dtype=np.int64)
    width += t32 >= 24
    width += t32 >= 256
    width += 2 * (t32 >= 65536)
    # Each token as 5 candidate bytes: the CBOR head, then its big-endian value; a mask keeps the
    # first `width` of them, which is the minimal (canonical) encoding.
    be = t32.astype(">u4").view(np.uint8).reshape(-1, 4)
    rows = np.zeros((t32.size, 5), dtype=np.uint8)
    rows[:, 0] = np.where(width == 1, t32, _CBOR_UINT_HEAD[width])
    rows[:, 1:5] = be
    two = width == 2
    rows[two, 1] = be[two, 3]
    three = width == 3
    rows[three, 1:3] = be[three, 2:4]
    keep = np.arange(5) < width[:, None]
    return rows[keep].tobytes(), np.cumsum(width)


def _array_header(n: int) -> bytes:
    # canonical CBOR major type 4 (array) header
    return cbor2.dumps([None] * n, canonical=True)[: -n] if n else b"\x80"


def _extras_tail(i: int, extras: Sequence[Extras] | None, lora_name: str | None,
                 cache_salt: str | None) -> bytes:
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name)
    if extras is not None and i < len(extras) and extras[i] is not None:
        keys.extend(extras[i])  # type: ignore[arg-type]
    if cache_salt is not None and i == 0:
        keys.append(cache_salt)
    return cbor2.dumps(tuple(keys), canonical=True) if keys else b"\xf6"


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int = 16,
    seed: str = DEFAULT_SEED,
    algo: str = DEFAULT_ALGO,
    extras: Sequence[Extras] | None = None,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[bytes]:
    """Hash every whole block of ``token_ids`` into a chain of keys.

    ``extras`` gives block i's extra keys (a tuple, or None); ``lora_name`` joins every block's
    extras first and ``cache_salt`` joins block 0's last, as vLLM orders them. Raises ValueError
    for an unknown algorithm, a non-positive block size or a token id outside uint32.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    digest = _digest_fn(algo)
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    if tokens.size and (tokens.dtype.kind not in "iu" or int(tokens.min()) < 0):
        raise ValueError("token ids must be non-negative integers")
    n_blocks = tokens.size // block_size
    if n_blocks == 0:
        return []
    encoded, ends = _encode_uints(tokens[: n_blocks * block_size])
    block_ends = ends[block_size - 1 :: block_size].tolist()
    prefix = b"\x83" + (b"\x58\x20" if algo == "sha256_cbor" else b"\x50")  # array(3), bytes(32|16)
    tok_header = _array_header(block_size)
    tails = [_extras_tail(i, extras, lora_name, cache_salt) for i in range(n_blocks)] \
        if (extras is not None or lora_name is not None or cache_salt is not None) else None
    parent = none_hash(seed, algo)
    out: list[bytes] = []
    begin = 0
    for i, end in enumerate(block_ends):
        tail = tails[i] if tails is not None else b"\xf6"  # CBOR null: no extras
        parent = digest(b"".join((prefix, parent, tok_header, encoded[begin:end], tail)))
        out.append(parent)
        begin = end
    return out


def reference_block_hashes(
    token_ids: Sequence[int],
    block_size: int = 16,
    seed: str = DEFAULT_SEED,
    algo: str = DEFAULT_ALGO,
    extras: Sequence[Extras] | None = None,
) -> list[bytes]:
    """Straightforward cbor2-per-block version of :func:`block_hashes` (tests compare the two)."""
    digest = _digest_fn(algo)
    parent = none_hash(seed, algo)
    out = []
    for i in range(len(token_ids) // block_size):
        toks = tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size])
        ex = extras[i] if extras is not None and i < len(extras) else None
        parent = digest(cbor2.dumps((parent, toks, ex), canonical=True))
        out.append(parent)
    return out
