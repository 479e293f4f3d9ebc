"""What the SDK's calls return: a lookup's hits, a save's and a load's counts, a stream's
arrivals and how it ended."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from kvstored_client.contract.proto import kvstored_pb2 as pb

TIER_NAMES: dict[int, str] = {pb.TIER_DRAM: "dram", pb.TIER_SSD: "ssd", pb.TIER_PEER: "peer"}


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prompt is cached: leading ``tokens`` (``blocks`` whole blocks), per tier."""

    tokens: int
    blocks: int
    per_tier: dict[str, int] = field(default_factory=dict)
    per_peer: dict[str, int] = field(default_factory=dict)   # lookup(peers=True): blocks after the local prefix


@dataclass(frozen=True, slots=True)
class BlockArrival:
    """Block ``index`` of a streamed prompt is in place: in the engine's buffers (``data`` is
    None), or copied out of the daemon into ``data`` (one row of bytes). ``tier``: where it was
    found ("dram", "ssd", or "peer": fetched from node ``peer`` just now)."""

    index: int
    tier: str
    peer: str
    data: Any


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """How a stream ended: ``blocks`` of ``requested`` arrived (``tokens`` of the prompt), then
    ``stop``: "complete", or why it stopped short ("missing", "peer_closed", "timeout", "corrupt",
    "unreachable", "peer_error", "no_room", "no_peers", "lease_ended"); the engine recomputes the
    rest."""

    blocks: int
    requested: int
    tokens: int
    stop: str
    detail: str

    @property
    def complete(self) -> bool:
        return self.stop == "complete"


@dataclass(frozen=True, slots=True)
class SaveResult:
    """``present``: leading blocks that were cached already; ``stored``: blocks added now."""

    present: int
    stored: int
    block_size: int

    @property
    def tokens(self) -> int:
        """Tokens of the prompt now cached from its start."""
        return (self.present + self.stored) * self.block_size


@dataclass(frozen=True, slots=True)
class LoadResult:
    """The cached prefix: ``blocks`` rows of ``data`` (a view of ``out`` when one was given)."""

    tokens: int
    blocks: int
    data: Any


SHORT_TIERS = 64   # below this many blocks a plain count beats numpy's set-up (~25 µs)


def reply_tiers(resp: pb.LookupResponse) -> Sequence[int]:
    """A lookup's tiers, one per hit block, packed (LookupRequest.packed_reply) or not (a daemon
    from before packed replies)."""
    return cast(Sequence[int], np.frombuffer(resp.packed_tiers, np.uint8) if resp.packed_tiers else resp.tiers)


def reply_offsets(resp: pb.LookupResponse) -> Sequence[int]:
    """A leased lookup's arena offsets, one per hit block, packed or not (see reply_tiers)."""
    return cast(Sequence[int], np.frombuffer(resp.packed_offsets, "<u8") if resp.packed_offsets else resp.offsets)


def per_tier(tiers: Sequence[int]) -> dict[str, int]:
    if len(tiers) < SHORT_TIERS:
        short: dict[str, int] = {}
        for tier in sorted(tiers):
            name = TIER_NAMES.get(tier, str(tier))
            short[name] = short.get(name, 0) + 1
        return short
    # numpy reads a reply's repeated field whole; a Counter over it took a Python step per block
    # (0.1-0.2 ms for a 32k-token prompt)
    counts = np.bincount(np.asarray(tiers, dtype=np.int64))
    return {TIER_NAMES.get(tier, str(tier)): int(counts[tier]) for tier in np.flatnonzero(counts).tolist()}


def loaded(resp: pb.LoadBlocksResponse, block_size: int) -> LookupResult:
    return LookupResult(resp.loaded_blocks * block_size, resp.loaded_blocks, per_tier(resp.tiers))
