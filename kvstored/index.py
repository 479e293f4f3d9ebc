"""Radix prefix index: the blocks of each namespace as a tree keyed by chained hashes.

A key is the hash of its whole prefix, so a chain of keys names a path from the root and the
longest cached prefix is the longest run of leading keys that are present and sealed. A block is
only inserted under a present parent and only leaves are removed, so the resident set is always
closed under ancestors: no cached block is ever orphaned.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class BlockState(enum.IntEnum):
    RESERVED = 0  # slot allocated, bytes being written; invisible to lookups
    SEALED = 1    # visible; readable under a lease


class Tier(enum.IntEnum):
    DRAM = 1


class Block:
    """One cached block. Mutable bookkeeping, kept small: there may be millions."""

    __slots__ = (
        "children",
        "index",
        "key",
        "lru_next",
        "lru_prev",
        "offset",
        "parent",
        "pins",
        "state",
        "tier",
    )

    def __init__(self, key: bytes, parent: Block | None, index: PrefixIndex, offset: int) -> None:
        self.key = key
        self.parent = parent
        self.index = index
        self.children = 0
        self.state = BlockState.RESERVED
        self.pins = 1  # the reservation that creates it
        self.offset = offset
        self.tier = Tier.DRAM
        self.lru_prev: Block | None = None
        self.lru_next: Block | None = None

    @property
    def evictable(self) -> bool:
        return self.state == BlockState.SEALED and self.pins == 0 and self.children == 0


class PrefixIndex:
    """The blocks of one namespace. Metadata only: it allocates and frees nothing."""

    __slots__ = ("_blocks", "namespace_id", "slot_bytes")

    def __init__(self, namespace_id: int) -> None:
        self._blocks: dict[bytes, Block] = {}
        self.namespace_id = namespace_id
        self.slot_bytes = 0  # arena slot size of this namespace's blocks, once known

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def match(self, keys: Sequence[bytes]) -> list[Block]:
        """The sealed blocks of the longest cached prefix of ``keys``, in order."""
        out: list[Block] = []
        blocks = self._blocks
        for key in keys:
            block = blocks.get(key)
            if block is None or block.state != BlockState.SEALED:
                break
            out.append(block)
        return out

    def insert(self, key: bytes, parent: Block | None, offset: int) -> Block:
        """Add a RESERVED block under ``parent`` (None = root); the key must be new."""
        assert key not in self._blocks, "insert of a key already present"
        assert parent is None or self._blocks.get(parent.key) is parent, "parent is not in the index"
        block = Block(key, parent, self, offset)
        self._blocks[key] = block
        if parent is not None:
            parent.children += 1
        return block

    def remove(self, block: Block) -> None:
        """Remove a leaf (evicted or aborted)."""
        assert block.children == 0, "removing an interior block would orphan its descendants"
        assert self._blocks.get(block.key) is block, "removing a block not in the index"
        del self._blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
