"""Storing a request's chain in a one-tier cache of ``capacity`` blocks under a policy, as the
trace replay does: the step the replay and the duel policy's shadow caches share."""

from __future__ import annotations

from collections.abc import Sequence

from kvstored.index import SEALED, Block, PrefixIndex
from kvstored.policy.interface import BlockPolicy


def store_chain(index: PrefixIndex, policy: BlockPolicy, keys: Sequence[bytes], hits: list[Block],
                capacity: int) -> None:
    """Store ``keys[len(hits):]`` behind ``hits`` (already matched, their hit already told to
    ``policy``): each key admitted, leaves evicted until there is room, the new blocks sealed and
    told to the policy together. Stops at the first key refused, or when nothing can be evicted."""
    for block in hits:
        block.pins += 1
    parent = hits[-1] if hits else None
    new: list[Block] = []
    for key in keys[len(hits):]:
        if not policy.admit(key, len(index) >= capacity):
            break
        while len(index) >= capacity:
            victim = policy.victim()
            if victim is None:
                break
            assert victim.evictable, "a policy picked a block that is not an evictable leaf"
            index.remove(victim)
            policy.removed(victim)
        if len(index) >= capacity:
            break
        parent = index.insert(key, parent, 0)  # pinned (pins=1) until the request is done
        new.append(parent)
    for block in new:
        block.flags |= SEALED
        block.pins -= 1
    if new:
        policy.inserted(new)
    for block in hits:
        block.pins -= 1
