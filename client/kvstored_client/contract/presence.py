"""The presence table: which blocks a daemon can serve now, in a shared-memory file its SDKs read.

Layout (little-endian): a :data:`HEADER` of 64 bytes (magic, version, bucket count, the daemon's
instance id, generation), then ``buckets`` buckets of :data:`SLOTS` uint64 slots (one cache line
each), then as many uint64 *where* words (word ``i`` belongs to slot ``i``), then one overflow
byte per bucket. A slot is 0 (free) or a block's :func:`fingerprint` with its two low bits
replaced by its state (:data:`DRAM`, :data:`SSD` or :data:`PROMOTING`; bit 2 is always set, so
no fingerprint is a free slot); a block's slot is in bucket ``(fingerprint >> BUCKET_SHIFT) %
buckets``.

A slot's where word says where the block's bytes are in the daemon's arena while they may be
read there without a lease: 0, or :func:`where` of the slot's arena offset and a publication
serial (:data:`SERIAL_BITS` bits, never 0, new at every publication). The daemon sets it only
while the slot is in state :data:`DRAM`, after the block's bytes are final and after the slot
word, and clears it before the slot word changes and before anything may write the arena slot
again (its slot given back, a promotion or a rewrite taking it). So a reader that finds the
block's slot in state DRAM, reads its where word, copies the bytes, then reads the slot word and
the where word again and finds them unchanged has copied that block's bytes (a seqlock: the
where word read twice names one publication, whose serial is new, throughout which the slot word
and the bytes stayed as they were). That takes loads that are not reordered with each other
(x86-64's order; the SDK reads without a lease nowhere else).

The daemon alone writes it, on its event loop, each change a single aligned 8-byte store (a slot
set, its state changed, or cleared); aligned 8-byte stores and loads are atomic on x86-64 and
AArch64, so a reader sees every slot either before or after a change, never torn. A bucket
whose eight slots were full when a block needed one has its overflow byte set for the life of the
table: a miss there is not an answer (the SDK asks the daemon), a hit still is.

A fingerprint mixes ALL of a key's bytes with the namespace id (engine hashes need not be
uniform); :func:`fingerprints` (numpy, many keys) and :func:`fingerprint` (one key, plain Python)
give identical values. Two readable blocks of one bucket whose fingerprints agree (61 bits, the
bucket's among them) would share a slot: for a table of 2^20 buckets, a chance of about 2^-41
for each pair of blocks in a bucket, left to chance.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable

import numpy as np

MAGIC = b"KVSPRES1"
VERSION = 2
HEADER = struct.Struct("<8sIIQQ32x")   # magic, version, buckets, instance id, generation
SLOTS = 8                              # slots a bucket: 64 bytes, one cache line
STATE_MASK = 3                         # the low bits of a slot that hold the state, not the fingerprint
BUCKET_SHIFT = 3                       # a bucket is named by the fingerprint's bits from bit 3 up
DRAM = 1        # readable in its DRAM slot
SSD = 2         # readable on SSD only
PROMOTING = 3   # in its DRAM slot while its bytes come up from SSD (a lookup reports it as DRAM)
_ALWAYS = 4     # set in every stored slot: a fingerprint is never 0 (a free slot)
_M64 = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15
_K2 = 0xBF58476D1CE4E5B9
_K3 = 0x94D049BB133111EB
_FP_BITS = _M64 & ~STATE_MASK
WHERE_UNIT = 64            # arena offsets are multiples of this (the daemon's slot alignment)
OFFSET_BITS = 40           # a where word's low bits: the offset in units (arenas up to 64 TiB)
SERIAL_BITS = 64 - OFFSET_BITS
OFFSET_MASK = (1 << OFFSET_BITS) - 1
MAX_ARENA_BYTES = WHERE_UNIT << OFFSET_BITS


def _splitmix(n: int) -> tuple[int, ...]:
    out, x = [], 0
    for _ in range(n):
        x = (x + _K1) & _M64
        z = ((x ^ (x >> 30)) * _K2) & _M64
        z = ((z ^ (z >> 27)) * _K3) & _M64
        out.append((z ^ (z >> 31)) | 1)   # odd: each word's product is a bijection of it
    return tuple(out)


MAX_KEY_BYTES = 128
_MULTIPLIERS = _splitmix(MAX_KEY_BYTES // 8)


def presence_table_path(grpc_socket: str) -> str:
    """Where a daemon serving gRPC on ``grpc_socket`` puts its table: the same directory (so the
    same permission rules), ``NAME.sock`` -> ``NAME.presence``."""
    base = grpc_socket[: -len(".sock")] if grpc_socket.endswith(".sock") else grpc_socket
    return f"{base}.presence"


def file_bytes(buckets: int) -> int:
    """The file's size for ``buckets`` buckets."""
    return HEADER.size + buckets * (SLOTS * 16 + 1)


def where(offset: int, serial: int) -> int:
    """The where word of arena ``offset`` (a multiple of :data:`WHERE_UNIT`) published with
    ``serial`` (1 to 2^SERIAL_BITS - 1): never 0. A serial comes back only after 2^24 - 1 more
    publications: a reader would have to stall that long (minutes of a busy daemon's seals)
    between its two reads, and find the same slot at the same offset, to be misled."""
    return (serial << OFFSET_BITS) | (offset // WHERE_UNIT)


def where_offset(word: int) -> int:
    """The arena offset a (nonzero) where word names."""
    return (word & OFFSET_MASK) * WHERE_UNIT


def bucket_count(blocks: int) -> int:
    """Buckets for a table of up to ``blocks`` blocks: a power of two, at most 2 blocks a bucket on
    average (a bucket of 8 then fills with probability ~2e-4), at least 64."""
    n = 64
    while n * 2 < blocks:
        n *= 2
    return n


def _words(size: int) -> int:
    return (size + 7) // 8


_UNPACK: dict[int, Callable[[bytes], tuple[int, ...]]] = {}


def _unpacker(size: int) -> Callable[[bytes], tuple[int, ...]]:
    """The 8-byte words of a ``size``-byte key (zero-padded), little-endian."""
    if not 0 < size <= MAX_KEY_BYTES:
        raise ValueError(f"keys of {size} bytes (1 to {MAX_KEY_BYTES})")
    words = struct.Struct(f"<{_words(size)}Q")
    pad = bytes(-size % 8)
    unpack: Callable[[bytes], tuple[int, ...]] = (lambda key: words.unpack(key + pad)) if pad else words.unpack
    _UNPACK[size] = unpack
    return unpack


def fingerprint(namespace_id: int, key: bytes) -> int:
    """One key's fingerprint (bits 0-1 clear, bit 2 set), as :func:`fingerprints` gives it: its
    8-byte words (zero-padded) times constants of their own, summed with the namespace's, mod
    2^64, then SplitMix64's finaliser, so that every bit of every byte reaches every bit."""
    size = len(key)
    unpack = _UNPACK.get(size) or _unpacker(size)
    h = (namespace_id * _K1 + size + sum(map(operator.mul, unpack(key), _MULTIPLIERS))) & _M64
    h = ((h ^ (h >> 30)) * _K2) & _M64
    h = ((h ^ (h >> 27)) * _K3) & _M64
    h ^= h >> 31
    return (h & _FP_BITS) | _ALWAYS


def fingerprints(namespace_id: int, packed: bytes, size: int) -> np.ndarray:
    """The fingerprints (uint64) of the ``size``-byte keys laid end to end in ``packed``: a few
    numpy passes per 8 bytes of a key, over all keys at once."""
    n = len(packed) // size
    width = _words(size) * 8
    if width == size:
        words = np.frombuffer(packed, "<u8", n * size // 8).reshape(n, size // 8)
    else:
        raw = np.zeros((n, width), np.uint8)
        raw[:, :size] = np.frombuffer(packed, np.uint8, n * size).reshape(n, size)
        words = raw.view("<u8")
    h = np.full(n, (namespace_id * _K1 + size) & _M64, np.uint64)
    for j in range(words.shape[1]):
        h += words[:, j] * np.uint64(_MULTIPLIERS[j])   # (uint64 arithmetic wraps: mod 2^64)
    h ^= h >> np.uint64(30)
    h *= np.uint64(_K2)
    h ^= h >> np.uint64(27)
    h *= np.uint64(_K3)
    h ^= h >> np.uint64(31)
    h &= np.uint64(_FP_BITS)
    h |= np.uint64(_ALWAYS)
    return h


def bucket_of(fp: int, buckets: int) -> int:
    """The bucket of fingerprint ``fp`` (``buckets`` a power of two)."""
    return (fp >> BUCKET_SHIFT) & (buckets - 1)
