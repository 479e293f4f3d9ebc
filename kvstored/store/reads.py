"""Reads: the longest cached prefix of a chain, its blocks leased in DRAM for a reader (brought
up from SSD as needed) or, unleased, promoted in the background; and the lookups' counts."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from operator import attrgetter

from kvstored.config import Config
from kvstored.index import HIT, NO_SLOT, Block, Tier
from kvstored.leases import Lease, LeaseKind, Session
from kvstored.store.catalog import NamespaceState
from kvstored.store.leasing import Leasing
from kvstored.store.placement import Placement
from kvstored.store.promotion import Promotion
from kvstored.store.values import CachedPrefix

# prefix_up(hits, tiers, k): the first k hits are in DRAM and leased (see Reads.lookup_chain)
PrefixUp = Callable[[list[Block], list[Tier], int], None]

_OFFSET = attrgetter("offset")   # a prefix's slots without a Python step per block


def tiers_of(blocks: Sequence[Block]) -> list[Tier]:
    """The tier of each block (the all-DRAM case, by far the most common, without a Python loop)."""
    if all(b.offset != NO_SLOT for b in blocks):
        return [Tier.DRAM] * len(blocks)
    return [Tier.DRAM if b.offset != NO_SLOT else Tier.SSD for b in blocks]


class Reads:
    """Lookups of resolved chains, and how many there were, of how many blocks, hitting how many."""

    def __init__(self, config: Config, leasing: Leasing, placement: Placement, promotion: Promotion) -> None:
        self._config = config
        self._leasing = leasing
        self._placement = placement
        self._promotion = promotion
        self.lookups = 0
        self.lookup_blocks = 0
        self.hit_blocks = 0
        self.hit_tokens = 0

    async def lookup_chain(self, state: NamespaceState, chain: list[bytes], session: Session | None,
                           prefix_up: PrefixUp | None = None,
                           on_lease: Callable[[int], None] | None = None, asked: int = 0) -> CachedPrefix:
        """Longest cached prefix of ``chain``, with the tier of each block; the lookup is counted
        as one of ``asked`` blocks (at least the chain's: more when it is a prompt's first keys).

        With ``session``, the hit blocks are brought to DRAM (awaiting SSD reads; a block that
        fails its checksum ends the prefix there) and leased for it, for a direct read; then
        ``on_lease`` learns the id of the hits' lease as it is taken, before any ``prefix_up``,
        and ``prefix_up(hits, tiers, k)`` learns, while SSD reads are still running, that the first
        ``k`` hits (found in ``tiers``) are in DRAM and leased (the result names no fewer, unless
        the lease was reaped meanwhile); when DRAM has no slot to give them but blocks waiting for
        their SSD copy, the reads wait for the write-back (up to ``dram.room_wait_s``). Without,
        blocks found on a slower tier start moving to DRAM in the background (prefetch)."""
        leasing, placement = self._leasing, self._placement
        namespace_id = state.namespace_id
        found = state.index.match_marking(chain, HIT)
        hits = found.blocks
        placement.dram.advance()
        placement.hit(hits)
        tiers = [Tier.DRAM] * len(hits) if found.settled else tiers_of(hits)
        lease_id = 0
        lost = False
        ttl = self._config.leases.ttl_s
        if session is not None and hits:
            held = leasing.pin(session, LeaseKind.READ, namespace_id, hits, ttl)
            if on_lease is not None:
                on_lease(held.lease_id)
            # in flight for quiesce() while its blocks come up (its lease is not busy yet, unless a
            # stream's): a load or leased lookup at SIGTERM finishes before its session ends
            # and takes the lease
            with leasing.lookup_in_flight():
                try:
                    if found.settled:
                        # what ensure_dram would find, without a step per block: nothing to read
                        # up, nothing in flight, every block pinned by the lease just taken
                        placement.dram.advance()
                        n = len(hits)
                    else:
                        up = None if prefix_up is None else functools.partial(
                            self._prefix_up, held, prefix_up, hits, tiers)
                        n = await self._promotion.ensure_dram(
                            hits, up, lambda: not leasing.doomed(held.lease_id),
                            asyncio.get_running_loop().time() + self._config.dram.room_wait_s)
                except BaseException:   # cancelled while blocks came up from SSD: the lease goes too
                    if leasing.live(held):
                        leasing.end(held, session, aborted=True)
                    for block in reversed(hits):   # a read that already failed left a hollow block
                        if not block.readable:
                            placement.remove_if_hollow(block)
                    raise
            if n < len(hits):
                if leasing.live(held):   # else its end unpinned them all
                    for block in hits[n:]:
                        block.pins -= 1
                    del held.pinned[n:]
                for block in reversed(hits[n:]):
                    placement.remove_if_hollow(block)
                hits = hits[:n]
                tiers = tiers[:n]
            lost = not leasing.live(held) or leasing.doomed(held.lease_id)
            if hits and not lost:
                lease_id = held.lease_id
                if not found.settled and any(t is not Tier.DRAM for t in tiers):
                    # the reply says the reader has ``ttl`` from now: the reads took some of it
                    leasing.renew(held, ttl)
            else:
                hits, tiers = [], []
                if leasing.live(held):
                    leasing.end(held, session, aborted=True)
        elif hits and not found.settled and any(not b.in_dram for b in hits):
            self._promotion.in_background(hits)
        self.lookups += 1
        self.lookup_blocks += max(len(chain), asked)
        self.hit_blocks += len(hits)
        self.hit_tokens += len(hits) * state.spec.block_size
        return CachedPrefix(len(hits), tiers, list(map(_OFFSET, hits)) if session is not None else [],
                            lease_id, ttl, state.spec.block_bytes, state.spec.block_size, lost)

    def _prefix_up(self, held: Lease, prefix_up: PrefixUp, hits: list[Block], tiers: list[Tier], k: int) -> None:
        # Only while the lookup's lease holds: once it ended (reaped, its session closed) the hits
        # are unpinned, and one in DRAM may lose its slot to another block before it is copied.
        # One doomed (busy when its session closed) still pins them, but nobody is listening.
        if self._leasing.live(held) and not self._leasing.doomed(held.lease_id):
            prefix_up(hits, tiers, k)

    def prefetch(self, state: NamespaceState, chain: list[bytes]) -> tuple[int, int]:
        """Start promoting the cached prefix's slower-tier blocks; returns (hit, promoting)."""
        hits = state.index.match(chain)
        # Not a hit for the policies: the load that follows a prefetch is. Its pages are in use.
        self._placement.dram.mark_pages(hits)
        slow = sum(1 for b in hits if not b.in_dram and self._promotion.pending(b) is None)
        if slow:
            self._promotion.in_background(hits)
        return len(hits), slow
