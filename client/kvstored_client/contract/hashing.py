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
MEMO_GROUP = 32   # blocks per memo entry of ChainHasher (a repeat re-hashes at most 31 blocks)

Extras = tuple[Any, ...] | None


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _hasher_fn(algo: str) -> Callable[[bytes], Any]:
    """The algorithm's constructor: ``_hasher_fn(algo)(data).digest()`` is its digest."""
    _digest_fn(algo)   # (refuses an unknown algorithm)
    return hashlib.sha256 if algo == "sha256_cbor" else xxhash.xxh3_128


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256_cbor":
        return _sha256_digest
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown hash algorithm {algo!r}; expected one of {', '.join(ALGORITHMS)}")


def none_hash(seed: str = DEFAULT_SEED, algo: str = DEFAULT_ALGO) -> bytes:
    """The parent hash of block 0: ``H(cbor(str(seed)))``."""
    return _digest_fn(algo)(cbor2.dumps(str(seed), canonical=True))


# CBOR's head byte of an unsigned int by its encoded width (1: the value itself, 2, 3, 5 bytes)
_CBOR_UINT_HEAD = np.array([0, 0, 0x18, 0x19, 0, 0x1A], dtype=np.uint8)


def _encode_uints(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """CBOR-encode each token as an unsigned int (canonical: the shortest form); returns the bytes
    and each token's end offset. Each token is laid out as 5 bytes (head, then its value's
    big-endian bytes) and the bytes its width does not use are masked out in one pass."""
    t = tokens.astype(np.uint32)
    n = t.size
    width = 1 + (t >= 24).astype(np.intp) + (t >= 256) + 2 * (t >= 65536)   # 1, 2, 3 or 5
    wide = np.empty((n, 5), dtype=np.uint8)
    wide[:, 1:] = t.astype(">u4").view(np.uint8).reshape(n, 4)
    wide[:, 0] = np.where(width == 1, wide[:, 4], _CBOR_UINT_HEAD[width])
    keep = np.empty((n, 5), dtype=bool)
    keep[:, 0] = True
    keep[:, 1] = keep[:, 2] = width == 5
    keep[:, 3] = width >= 3
    keep[:, 4] = width >= 2
    return wide[keep].tobytes(), np.cumsum(width)


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
    if cache_salt and i == 0:   # an empty salt is no salt, as in vLLM
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
    extras first and ``cache_salt`` (unless empty) joins block 0's last, as vLLM orders them. Raises ValueError
    for an unknown algorithm, a non-positive block size or a token id outside uint32.
    """
    return ChainHasher(block_size, seed, algo, memo_blocks=0).hashes(
        token_ids, extras, cache_salt=cache_salt, lora_name=lora_name)


def checked_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` as an array, checked as :func:`block_hashes` checks them: one-dimensional,
    integers in 0..2**32-1 (ValueError otherwise)."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    if tokens.size and (tokens.dtype.kind not in "iu" or int(tokens.min()) < 0):
        raise ValueError("token ids must be non-negative integers")
    if tokens.size and int(tokens.max()) >= 1 << 32:
        raise ValueError("token ids must be below 2**32")
    return tokens


class ChainHasher:
    """:func:`block_hashes` with a bounded memo of recent blocks, for a client that sees the same
    prefixes again and again: a group of MEMO_GROUP blocks already hashed under the same parent
    costs a dict lookup instead of their encoding and hashes (a prompt's last, partial group is
    hashed anew). Results are identical with or without the memo."""

    def __init__(self, block_size: int = 16, seed: str = DEFAULT_SEED, algo: str = DEFAULT_ALGO,
                 memo_blocks: int = 1 << 17) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self._hasher = _hasher_fn(algo)
        self._block_size = block_size
        self._root = none_hash(seed, algo)
        self._prefix = b"\x83" + (b"\x58\x20" if algo == "sha256_cbor" else b"\x50")  # array(3), bytes
        self._tok_header = _array_header(block_size)
        self._memo: dict[bytes, tuple[bytes, ...]] = {}
        self._memo_blocks = memo_blocks

    def hashes(self, token_ids: Sequence[int] | np.ndarray, extras: Sequence[Extras] | None = None, *,
               cache_salt: str | None = None, lora_name: str | None = None) -> list[bytes]:
        """The chain of keys of every whole block of ``token_ids`` (see :func:`block_hashes`)."""
        bs = self._block_size
        tokens = checked_tokens(token_ids)
        n_blocks = tokens.size // bs
        if n_blocks == 0:
            return []
        tails = [_extras_tail(i, extras, lora_name, cache_salt) for i in range(n_blocks)] \
            if (extras is not None or lora_name is not None or cache_salt) else None
        out: list[bytes] = []
        parent = self._root
        memo = self._memo
        group = MEMO_GROUP
        span = 4 * bs * group   # a group's bytes in ``raw``
        raw = b""
        if self._memo_blocks:
            raw = tokens[: n_blocks * bs].astype("<u4").tobytes()
            for g in range(n_blocks // group):
                known = memo.get(parent + raw[g * span:(g + 1) * span]
                                 + (b"".join(tails[g * group:(g + 1) * group]) if tails else b""))
                if known is None:
                    break
                out.extend(known)
                parent = known[-1]
        first = len(out)
        if first == n_blocks:
            return out
        encoded, ends = _encode_uints(tokens[first * bs: n_blocks * bs])
        block_ends = ends[bs - 1:: bs].tolist()
        # (the loop is the interpreter's: each name it uses is a local; nothing else is in it)
        hasher, prefix, header, append = self._hasher, self._prefix, self._tok_header, out.append
        begin = 0
        if tails:
            for end, tail in zip(block_ends, tails[first:]):
                parent = hasher(b"".join((prefix, parent, header, encoded[begin:end], tail))).digest()
                append(parent)
                begin = end
        else:
            for end in block_ends:   # (b"\xf6": CBOR null, no extras)
                parent = hasher(b"".join((prefix, parent, header, encoded[begin:end], b"\xf6"))).digest()
                append(parent)
                begin = end
        if self._memo_blocks:
            # one entry per whole group of blocks (its parent and tokens -> its hashes): an entry
            # per block cost about as much as the hash itself
            for g in range(first // group, n_blocks // group):
                if len(memo) * group >= self._memo_blocks:
                    memo.clear()  # bounded; a cold start costs one prompt's hashing, nothing else
                memo[(out[g * group - 1] if g else self._root) + raw[g * span:(g + 1) * span]
                     + (b"".join(tails[g * group:(g + 1) * group]) if tails else b"")] = \
                    tuple(out[g * group:(g + 1) * group])
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
