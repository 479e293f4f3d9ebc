"""SSD residency: which blocks have a copy on the SSD tier, the bytes those copies take, and the
SSD eviction policy (one for every block size).

Metadata and decisions only: the tier (``kvstored.tiers.ssd``) holds the bytes; writing copies is
the write-back's, reading them the promotion's, and removing blocks :class:`Placement`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstored.config import Config
from kvstored.index import NO_SLOT, ON_SSD, PROMOTING, Block
from kvstored.policy.interface import BlockPolicy
from kvstored.policy.registry import make_policy
from kvstored.store.dram_residency import MIN_GHOST_BLOCKS
from kvstored.tiers.ssd import SSDTier

# The SSD tier holds blocks of every namespace's size; its policy's ghost list is sized as if they
# were of this many bytes (16 tokens of an 8B model at tensor parallel 2), a bound on its memory.
GHOST_BLOCK_BYTES = 1 << 20


def ssd_can_evict(block: Block) -> bool:
    """May an SSD-only block leave the index now (an evictable leaf not on its way to DRAM)?"""
    return block.evictable and block.offset == NO_SLOT and not block.flags & PROMOTING


class SsdResidency:
    """The SSD copies' accounting: bytes used (copies written or being written) against the
    watermarks, blocks with a copy, and the SSD policy, which tracks the SSD-only blocks."""

    def __init__(self, config: Config, clock: Callable[[], float], tier: SSDTier | None) -> None:
        self._config = config
        self._tier = tier
        self.policy: BlockPolicy = make_policy(config.ssd.policy, clock,
                                               max(config.ssd.capacity // GHOST_BLOCK_BYTES, MIN_GHOST_BLOCKS),
                                               can_evict=ssd_can_evict, lane=1, defer=True, observed=True)
        self._used = 0
        # blocks with an SSD copy (ON_SSD), kept as they gain and lose it: stats() (every scrape)
        # must not walk millions of blocks on the event loop to count them
        self._blocks = 0
        self._copied = 0   # bytes of the copies written (of the ``_blocks``), for their mean size
        self._told = 0     # the capacity in blocks last told to the policy (_measure)

    @property
    def enabled(self) -> bool:
        """Whether there is an SSD tier."""
        return self._tier is not None

    @property
    def used_bytes(self) -> int:
        """Bytes of the copies written and of those being written."""
        return self._used

    @property
    def blocks(self) -> int:
        return self._blocks

    @property
    def high_bytes(self) -> float:
        """The high watermark in bytes: writes keep the copies under it."""
        cfg = self._config.ssd
        return cfg.high_watermark * cfg.capacity

    def fits(self, nbytes: float) -> bool:
        """Whether ``nbytes`` more fit under the high watermark."""
        return self._used + nbytes <= self.high_bytes

    def low_target(self, nbytes: float) -> float:
        """How far evictions go down so that ``nbytes`` more fit: to the low watermark, or lower."""
        cfg = self._config.ssd
        return max(0.0, min(cfg.low_watermark * cfg.capacity, self.high_bytes - nbytes))

    def reserve(self, nbytes: int) -> None:
        """A copy of ``nbytes`` is being written: count it now, so that a round cannot overfill."""
        self._used += nbytes

    def unreserve(self, nbytes: int) -> None:
        """A copy :meth:`reserve` counted was not written after all."""
        self._used -= nbytes

    def written(self, block: Block, check: int) -> None:
        """``block``'s copy (its bytes reserved) is on SSD now, the xxh3-64 of its bytes ``check``."""
        block.flags |= ON_SSD
        block.index.changed(block)
        self._blocks += 1
        self._copied += block.index.block_bytes
        block.check = check
        self._measure()

    def _measure(self) -> None:
        """Tell the policy how many blocks the tier holds when full, at its blocks' mean size,
        once that moved by more than 1% (its sizing assumed blocks of GHOST_BLOCK_BYTES)."""
        if not self._copied:
            return
        blocks = int(self.high_bytes * self._blocks / self._copied)
        if abs(blocks - self._told) > self._told / 100:
            self._told = blocks
            self.policy.resize(blocks)

    def restored(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        """``blocks`` (parents first, each marked ON_SSD) were found on the tier at start, with
        the reuse counts their records kept."""
        self._blocks += len(blocks)
        restored = sum(b.index.block_bytes for b in blocks)
        self._used += restored
        self._copied += restored
        self.policy.inserted(blocks, reuses)   # parents first, as the policies expect
        self._measure()

    def dropped(self, block: Block, leaving: bool) -> None:
        """``block`` loses its SSD copy (deleted from the tier); ``leaving``: the index too,
        before anything else runs (which tells the presence table)."""
        self.policy.removed(block, moved=block.in_dram and not leaving)   # still in DRAM, or gone
        block.flags &= ~ON_SSD
        if not leaving:
            block.index.changed(block)
        self._blocks -= 1
        self._used -= block.index.block_bytes
        self._copied -= block.index.block_bytes
        if self._tier is not None:
            self._tier.delete(block.index.namespace_id, block.key)
