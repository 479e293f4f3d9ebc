"""The store's tier events: an observer told each time a block gains or loses a copy in a tier.

Placement calls it where a sealed block gets a DRAM slot or an SSD copy and where it loses one
(promotion when a block read up from SSD lands, restore for the blocks found on SSD at start).
Calls run on the event loop and must return at once: an observer that publishes queues the
news and sends it elsewhere. The store never depends on what the observer does with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstored.index import Block, Tier


class TierEvents(Protocol):
    """What a store observer is told. ``blocks``: readable blocks of one namespace, a chain in
    order where the caller has one (parents before their children)."""

    def stored(self, blocks: Sequence[Block], tier: Tier) -> None:
        """``blocks`` now have a copy in ``tier``."""

    def removed(self, blocks: Sequence[Block], tier: Tier) -> None:
        """``blocks`` no longer have a copy in ``tier``."""

    def cleared(self) -> None:
        """Every block is gone from every tier (a start with an empty store)."""


class NoEvents:
    """The default observer: nobody listens."""

    def stored(self, blocks: Sequence[Block], tier: Tier) -> None:
        pass

    def removed(self, blocks: Sequence[Block], tier: Tier) -> None:
        pass

    def cleared(self) -> None:
        pass


NO_EVENTS = NoEvents()
