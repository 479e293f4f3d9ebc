"""The values the block store takes and answers with (frozen: they cross component boundaries)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvstored.index import Tier
from kvstored.store.waits import WaitSnapshot


@dataclass(frozen=True, slots=True)
class KeyRequest:
    """A chain of blocks as the client named it: engine hashes, or token ids to hash here."""

    hashes: Sequence[bytes] = ()
    token_ids: Sequence[int] = ()
    cache_salt: str = ""
    lora_name: str = ""
    packed_hashes: bytes = b""   # the hashes end to end, each of the namespace's digest size


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A lookup's answer: the longest cached prefix, the tier of each block and, when leased, the
    DRAM offset of each and the lease holding them."""

    blocks: int
    tiers: list[Tier]
    offsets: list[int]
    lease_id: int
    lease_ttl_s: float
    block_bytes: int
    block_size: int
    lease_lost: bool = False   # the hits' lease ended (released, reaped) while they came up from SSD


@dataclass(frozen=True, slots=True)
class Reservation:
    reservation_id: int
    present: int
    offsets: list[int]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Commit:
    """A commit's answer: blocks cached before, blocks stored, and the slots added to the
    session's spares (the slots of rows not used, then new ones)."""

    present: int
    stored: int
    spare_offsets: list[int]


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    evictions: int
    write_errors: int = 0
    read_errors: int = 0


@dataclass(frozen=True, slots=True)
class StoreStats:
    uptime_s: float
    tiers: list[TierStats]
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    hit_tokens: int
    saved_blocks: int
    active_leases: int
    clients: int
    namespaces: int
    index_blocks: int
    promotions: int
    demotions: int
    dropped_blocks: int
    peer_fetched_blocks: int = 0
    peer_served_blocks: int = 0
    peer_received_blocks: int = 0
    dropped_by_reason: Mapping[str, int] = field(default_factory=dict)   # dropped_blocks by reason
    room_waits: WaitSnapshot | None = None   # saves' waits for the write-back to make room


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a streamed load ended: ``blocks`` of ``requested`` arrived, then ``stop`` ("complete",
    or why it stopped short). ``lease_id``: arena mode, the lease holding the blocks (0: none)."""

    blocks: int
    requested: int
    stop: str
    detail: str
    lease_id: int
    lease_ttl_s: float


@dataclass(frozen=True, slots=True)
class FlushProgress:
    """How far a flush is: blocks it wrote to SSD so far, and blocks of the flushed namespaces
    still only in DRAM (saves during the flush add to them)."""

    written: int
    left: int
    done: bool = False


@dataclass(frozen=True, slots=True)
class RestoreReport:
    namespaces: int
    blocks: int
    dropped: int
    evicted: int = 0   # over ssd.capacity (lowered since the blocks were written): evicted at once
