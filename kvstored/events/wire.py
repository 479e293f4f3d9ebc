"""KV events on the wire, in vLLM's format (``vllm/distributed/kv_events.py``), so that routers
built for vLLM (Dynamo, llm-d, SGLang's gateway) read a daemon's events unchanged.

A ZMQ PUB message is three frames: ``[topic, seq, payload]``; ``seq`` is 8 bytes big-endian and
``payload`` a msgpack batch ``[ts, [event, ...], data_parallel_rank]``. An event is a map tagged
by ``"type"``: ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name}``, ``BlockRemoved{block_hashes, medium}`` or ``AllBlocksCleared{}``. The
decoder also takes the older tagged arrays (``["BlockStored", hashes, parent, tokens, size,
lora_id, medium, ...]``). Hashes are the 32-byte keys or, as vLLM sends by default, their last 8
bytes as a big-endian unsigned int.

kvstored adds, where vLLM's consumers ignore it: ``namespace_id`` on each block event (the
daemon holds several namespaces; vLLM engines hold one), and the **epoch** in ``seq``: the top
23 bits (below the sign) are a number drawn at each start, the low 40 count the batches from 0,
so every frame says which run of the daemon sent it and a restart never looks like a
continuation. The end of a replay is ``seq`` -1, as in vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

SEQ_BITS = 40                        # batches of one epoch
EPOCH_BITS = 23                      # epochs (the sign bit stays clear: -1 ends a replay)
END_OF_REPLAY = -1
SNAPSHOT_REQUEST = b"kvstored-snapshot"   # on the replay socket (a replay request is 8 bytes)


class Medium(enum.StrEnum):
    """Where a block's copy is, as vLLM names it: ``GPU`` in an engine, ``CPU`` in the daemon's
    DRAM, ``DISK`` on its SSD."""

    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"


class HashFormat(enum.StrEnum):
    INT64 = "int64"   # the key's last 8 bytes, big-endian, unsigned (vLLM's default)
    BYTES = "bytes"   # the key itself


class WireError(ValueError):
    """A frame or payload that is not a KV event batch; the message says what was wrong."""


# The two block events are NamedTuples rather than frozen dataclasses: a router decodes hundreds
# of thousands a second, and a frozen dataclass takes five times as long to build.
class BlockStored(NamedTuple):
    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    block_size: int
    medium: str
    token_ids: tuple[int, ...] = ()
    lora_name: str | None = None
    namespace_id: int | None = None


class BlockRemoved(NamedTuple):
    block_hashes: tuple[int | bytes, ...]
    medium: str
    namespace_id: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None


def make_seq(epoch: int, n: int) -> int:
    """The sequence number of batch ``n`` (from 0) of ``epoch``."""
    if not 0 <= epoch < 1 << EPOCH_BITS or not 0 <= n < 1 << SEQ_BITS:
        raise ValueError(f"epoch {epoch} or batch number {n} out of range")
    return epoch << SEQ_BITS | n


def epoch_of(seq: int) -> int:
    return seq >> SEQ_BITS


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise WireError(f"a sequence number is 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def wire_hash(key: bytes, fmt: HashFormat) -> int | bytes:
    """A block key as events carry it."""
    return int.from_bytes(key[-8:], "big") if fmt is HashFormat.INT64 else key


def hash64(value: int | bytes) -> int:
    """Either wire form as the 64-bit int an index keys on (the int form is already that)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & 0xFFFF_FFFF_FFFF_FFFF   # a signed int64 from a consumer that wrote one


def _event_map(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                               "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                               "block_size": event.block_size, "lora_id": None, "medium": event.medium,
                               "lora_name": event.lora_name}
    elif isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    else:
        return {"type": "AllBlocksCleared"}
    if event.namespace_id is not None:
        out["namespace_id"] = event.namespace_id
    return out


def encode_batch(batch: Batch) -> bytes:
    return msgpack.packb([batch.ts, [_event_map(e) for e in batch.events], batch.dp_rank], use_bin_type=True)


_HASH_TYPES = {int, bytes}


def _hashes(value: Any) -> tuple[int | bytes, ...]:
    # one set of the types present, not a check per hash: this runs for every event received
    if not isinstance(value, (list, tuple)) or not set(map(type, value)) <= _HASH_TYPES:
        raise WireError("block_hashes must be a list of ints or byte strings")
    return tuple(value)


def _parent(value: Any) -> int | bytes | None:
    if value is not None and type(value) not in _HASH_TYPES:
        raise WireError("parent_block_hash must be an int, bytes or null")
    return value  # type: ignore[no-any-return]


def _decode_event(raw: Any) -> Event:
    # type() checks and no helper calls on the common path: this runs for every event received
    if type(raw) is dict:
        kind = raw.get("type")
        if kind == "BlockStored" or kind == "BlockRemoved":
            hashes = raw.get("block_hashes")
            medium = raw.get("medium") or Medium.GPU.value   # null before vLLM had media: its GPU cache
            namespace_id = raw.get("namespace_id")
            if type(hashes) is not tuple or not set(map(type, hashes)) <= _HASH_TYPES:
                raise WireError("block_hashes must be a list of ints or byte strings")
            if type(medium) is not str:
                raise WireError("medium must be a string")
            if namespace_id is not None and type(namespace_id) is not int:
                raise WireError("namespace_id must be an int")
            if kind == "BlockRemoved":
                return BlockRemoved(hashes, medium, namespace_id)
            size = raw.get("block_size", 0)
            if type(size) is not int:
                raise WireError("block_size must be an int")
            lora = raw.get("lora_name")
            return BlockStored(hashes, _parent(raw.get("parent_block_hash")), size, medium, (),
                               lora if type(lora) is str else None, namespace_id)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        raise WireError(f"unknown event type {str(kind)[:40]!r}")
    if isinstance(raw, (list, tuple)) and raw:   # the tagged-array form of older vLLM releases
        kind = raw[0]
        if kind == "BlockStored" and len(raw) >= 5:
            medium = raw[6] if len(raw) > 6 else None
            return BlockStored(_hashes(raw[1]), _parent(raw[2]), _int(raw[4], "block_size"), _medium(medium))
        if kind == "BlockRemoved" and len(raw) >= 2:
            return BlockRemoved(_hashes(raw[1]), _medium(raw[2] if len(raw) > 2 else None))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        raise WireError(f"unknown or short event {str(kind)[:40]!r}")
    raise WireError("an event is a map tagged by 'type' or a tagged array")


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError(f"{name} must be an int")
    return value


def _medium(value: Any) -> str:
    # vLLM before media left it null: the engine's own GPU cache
    if value is None:
        return Medium.GPU.value
    if not isinstance(value, str):
        raise WireError("medium must be a string")
    return value


def decode_batch(payload: bytes) -> Batch:
    """A payload as sent; WireError for anything else (the caller drops it and says so)."""
    try:
        # arrays as tuples: the events keep their hashes without a copy
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise WireError("a batch is [ts, [events], dp_rank]")
    ts = raw[0]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise WireError("a batch's ts must be a number")
    rank = raw[2] if len(raw) > 2 else None
    return Batch(float(ts), tuple(map(_decode_event, raw[1])), rank if isinstance(rank, int) else None)


def medium_rank(medium: str) -> int:
    """0 for the engine's GPU, 1 for host memory, 2 for disk and anything slower; Dynamo's
    grouping of medium names (CPU* host; DISK, NVME, CPU_TIER2 and the rest slower)."""
    name = medium.upper()
    if name == "GPU":
        return 0
    if name.startswith("CPU") and name != "CPU_TIER2":
        return 1
    return 2


def chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]
