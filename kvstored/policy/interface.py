"""The interface every block eviction/admission policy offers to the store and the trace replay.

A policy sees block metadata and nothing else: which blocks were stored, which a lookup hit, which
left the index, and (for the time-aware ones) an injected clock. It answers two questions: may a
new block come in (``admit``), and which block should leave next (``victim``). It never removes
anything itself; the caller removes the victim from the index and tells the policy.

Leaf-only: ``victim`` returns only a block for which ``Block.evictable`` holds (sealed, unpinned,
no resident children), so evicting it can never orphan a cached descendant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvstored.index import Block


class BlockPolicy(Protocol):
    """Eviction order and admission for the blocks of one tier (all namespaces of a slot size)."""

    name: str

    def __len__(self) -> int:
        """Blocks tracked (stored and not yet removed)."""
        ...

    def __contains__(self, block: object) -> bool: ...

    def admit(self, key: bytes, full: bool) -> bool:
        """May the block named ``key`` be stored? ``full``: storing it needs an eviction.

        Called once per new block, before its slot is allocated; a refusal ends the chain there
        (a child cannot be stored without its parent).
        """
        ...

    def inserted(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        """``blocks`` (parents before their children) were stored and sealed, or came into this
        tier: start tracking them. Runs of one chain may come in any order (a child's run before
        its parent's): a parent is no leaf while a tracked child hangs under it.

        ``reuses``, for blocks that moved here from another tier: per block, how often it had
        been reused there (:meth:`reuses` of that tier's policy), so that its history goes with
        it; a policy that ranks by reuse starts it there. None: new blocks (or no history).
        """
        ...

    def reuses(self, block: Block) -> int | None:
        """How often a tracked block has been reused as far as this tier knows, reuses carried in
        with it included; None when it is not tracked. Hits are recorded lazily (on the deepest
        tracked block of a prefix), so a block with tracked children may not count its latest
        ones yet; a leaf's count is exact. Read before :meth:`removed` when a block moves."""
        ...

    def pending_hits(self, block: Block) -> int:
        """The hits recorded on a tracked block (of lookups that ended at it, or folded in from
        its removed descendants) that have not reached its tracked ancestors yet: they do when it
        is removed, unless its parent has gone first. 0 when untracked. A caller that moves a
        prefix to another tier parent first adds them to the ancestors' :meth:`reuses`."""
        ...

    def hit(self, blocks: Sequence[Block]) -> None:
        """A lookup matched ``blocks``, the parent-first prefix of a chain: mark them used."""
        ...

    def seen_hit(self, blocks: Sequence[Block]) -> None:
        """The store as a whole (any tier) hit ``blocks``, a parent-first prefix. A lower tier's
        policy made ``observed`` learns from the whole store's accesses (which are what its
        blocks' worth depends on), not from the share that reaches it; the others ignore it."""
        ...

    def seen_stored(self, blocks: Sequence[Block]) -> None:
        """The store as a whole stored ``blocks`` (parents first; in another tier): as
        :meth:`seen_hit`."""
        ...

    def resize(self, capacity_blocks: int) -> None:
        """The tier holds about ``capacity_blocks`` blocks when full, as measured (the SSD tier
        holds blocks of every size, so it learns this as blocks are written): a policy that
        simulates the tier (``duel``'s shadows) sizes itself so; the others ignore it."""
        ...

    def removed(self, block: Block, moved: bool = False) -> None:
        """``block`` left the index (evicted, aborted or lost) or, with ``moved``, only this tier
        (its bytes stay in another: it may come back by a move, which is not a reuse); untracked
        blocks are ignored. May be called before or after ``PrefixIndex.remove``."""
        ...

    def catch_up(self) -> None:
        """Do the work a policy made with ``defer`` put off (a sampling policy's shadow replay)
        now; a store calls it once its reply is out. Without the call it is done first thing in
        the next call: the decisions are the same either way."""
        ...

    def learned(self) -> dict[str, float]:
        """What the policy has learned of the workload (a scale, weights), kept with the SSD tier
        so that a restart resumes from it; {} for a policy that learns nothing."""
        ...

    def resume(self, learned: Mapping[str, float]) -> None:
        """Start from what :meth:`learned` gave before a restart (before any block is tracked);
        missing or unknown entries are ignored, values out of range brought into it."""
        ...

    def victim(self) -> Block | None:
        """The block to evict next (evictable, hence a leaf), or None when no tracked block is."""
        ...


class OwnAccessesOnly:
    """What a policy that learns only from its own tier's accesses answers to the store's
    (``seen_hit``, ``seen_stored``) and to the tier's measured size (``resize``): nothing."""

    def seen_hit(self, blocks: Sequence[Block]) -> None:
        pass

    def seen_stored(self, blocks: Sequence[Block]) -> None:
        pass

    def resize(self, capacity_blocks: int) -> None:
        pass
