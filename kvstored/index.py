"""Radix prefix index: the blocks of each namespace as a tree keyed by chained hashes.

A key is the hash of its whole prefix, so a chain of keys names a path from the root and the
longest cached prefix is the longest run of leading keys whose blocks hold data. A block is only
inserted under a present parent and only leaves leave the index, so no cached block is ever
orphaned. Where a block's bytes are (DRAM slot, SSD copy, both) is recorded here; moving them is
the tiers' business.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Protocol, cast

from kvstored_client.contract import presence as presence_layout

# Block.flags bits (one small int instead of several fields: there may be millions of blocks)
SEALED = 1      # bytes complete; visible to lookups
ON_SSD = 2      # a verified copy is in the SSD tier
HIT = 4         # matched by a lookup since it was stored
DEMOTING = 8    # being written to the SSD tier
PROMOTING = 16  # being read up from the SSD tier into its DRAM slot
SSD_DECLINED = 32   # the SSD tier's policy refused it (full of blocks worth more): it may leave DRAM uncopied
WRITE_FAILED = 64   # its last write to the SSD tier failed: it may leave DRAM uncopied
NO_SLOT = -1    # Block.offset when the block has no DRAM slot

# What the presence table records of a block (0: not readable)
PRESENT_DRAM = presence_layout.DRAM
PRESENT_SSD = presence_layout.SSD
PRESENT_PROMOTING = presence_layout.PROMOTING


class Observer(Protocol):
    """Told of every change of a block's presence (see PrefixIndex.changed): the presence table."""

    def set(self, namespace_id: int, key: bytes, state: int, offset: int = -1) -> None: ...

    def set_many(self, namespace_id: int, keys: list[bytes], states: list[int],
                 offsets: list[int] | None = None) -> None: ...


_cached = functools.partial(operator.is_not, None)   # a look-up that found a block, tested in C
# One int object per depth, shared by every block at it: Python caches only ints up to 256, and a
# 32k-token prompt's blocks are 2,048 deep (28 B a block otherwise; ~0.5 MB once)
_DEPTHS = tuple(range(1 << 14))


class Tier(enum.IntEnum):
    DRAM = 1
    SSD = 2
    PEER = 3   # held by another node (reported by lookups that ask peers; never a Block's tier)


class Block:
    """One cached block. Mutable bookkeeping, kept small."""

    __slots__ = ("check", "children", "depth", "flags", "index", "key", "lane0_n", "lane0_t", "lane1_n",
                 "lane1_t", "offset", "parent", "pins")

    def __init__(self, key: bytes, parent: Block | None, index: PrefixIndex, offset: int, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.index = index
        self.children = 0
        self.flags = 0
        self.pins = 1  # the reservation or restore that creates it
        self.offset = offset
        self.depth = depth
        self.check: int | None = None  # xxh3-64 of the bytes once computed (serving it to peers)
        self.lane0_t = self.lane1_t = 0.0
        self.lane0_n = self.lane1_n = 0

    @property
    def sealed(self) -> bool:
        return bool(self.flags & SEALED)

    @property
    def in_dram(self) -> bool:
        return self.offset != NO_SLOT

    @property
    def on_ssd(self) -> bool:
        return bool(self.flags & ON_SSD)

    @property
    def readable(self) -> bool:
        """Sealed and holding its bytes somewhere (not a hollow block that lost them)."""
        return bool(self.flags & SEALED) and (self.offset != NO_SLOT or bool(self.flags & ON_SSD))

    @property
    def presence(self) -> int:
        """What a lookup would find of it: PRESENT_DRAM, PRESENT_PROMOTING (in its slot, its bytes
        still coming up), PRESENT_SSD, or 0 (unsealed or hollow: not readable)."""
        flags = self.flags
        if not flags & SEALED:
            return 0
        if self.offset != NO_SLOT:
            return PRESENT_PROMOTING if flags & PROMOTING else PRESENT_DRAM
        return PRESENT_SSD if flags & ON_SSD else 0

    @property
    def tier(self) -> Tier:
        return Tier.DRAM if self.offset != NO_SLOT else Tier.SSD

    @property
    def evictable(self) -> bool:
        """Can leave the index now: sealed, unpinned, not being written out, and a leaf."""
        return self.flags & (SEALED | DEMOTING) == SEALED and self.pins == 0 and self.children == 0


@dataclass(frozen=True, slots=True)
class Match:
    """The readable blocks of a cached prefix, and whether each is settled in DRAM: in its slot
    with no promotion in flight (its bytes are there to read now)."""

    blocks: list[Block]
    settled: bool


class PrefixIndex:
    """The blocks of one namespace. Metadata only: it allocates and frees nothing."""

    __slots__ = ("_blocks", "block_bytes", "namespace_id", "observer", "slot_bytes")

    def __init__(self, namespace_id: int, observer: Observer | None = None) -> None:
        self._blocks: dict[bytes, Block] = {}
        self.namespace_id = namespace_id
        self.block_bytes = 0  # payload size of this namespace's blocks, once known
        self.slot_bytes = 0   # arena slot size of those blocks, once known
        self.observer = observer   # told of every change of a block's presence (the presence table)

    def changed(self, block: Block) -> None:
        """``block``'s flags or slot changed: the observer learns its presence now. Called by
        whatever sets or clears SEALED, ON_SSD or PROMOTING or gives a sealed block a slot or
        takes it, before the loop runs anything else (so no call sees the observer behind the
        index); harmless when nothing changed. The observer also learns the block's slot, whose
        bytes SDKs may then read without a lease while it stays PRESENT_DRAM there: so a block
        turns PRESENT_DRAM only once its slot's bytes are final, and stops before its slot is
        given back or written again (see DramResidency.release)."""
        if self.observer is not None:
            self.observer.set(self.namespace_id, block.key, block.presence, block.offset)

    def changed_many(self, blocks: Sequence[Block]) -> None:
        """:meth:`changed` for each of ``blocks``."""
        if self.observer is not None:
            self.observer.set_many(self.namespace_id, [b.key for b in blocks], [b.presence for b in blocks],
                                   [b.offset for b in blocks])

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._blocks.values()))

    def get(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def match(self, keys: Sequence[bytes]) -> list[Block]:
        """The readable blocks of the longest cached prefix of ``keys``, in order."""
        out: list[Block] = []
        blocks = self._blocks
        for key in keys:
            block = blocks.get(key)
            # inline Block.readable: this loop runs once per block of every lookup
            if block is None or not block.flags & SEALED or (block.offset == NO_SLOT and not block.flags & ON_SSD):
                break
            out.append(block)
        return out

    def match_marking(self, keys: Sequence[bytes], mark: int) -> Match:
        """:meth:`match`, setting the flag bits ``mark`` on every block found, and whether all of
        them are settled in DRAM: a lookup learns all it needs per block in one pass (a 32k-token
        prompt is 2,048 blocks, and each pass over them costs ~0.1 ms)."""
        get = self._blocks.get
        # The dict look-ups in C. When the last key is cached so is every key before it (a key
        # hashes its whole prefix, and only leaves leave), and all are looked up in one go; else
        # they stop at the first miss, not to look up a long uncached suffix.
        if keys and get(keys[-1]) is None:
            found: list[Block | None] = list(takewhile(_cached, map(get, keys)))
        else:
            found = list(map(get, keys))
        settled = True
        n = len(found)
        for i, block in enumerate(found):
            if block is None:
                n = i
                break
            flags = block.flags
            if not flags & SEALED:
                n = i
                break
            if block.offset == NO_SLOT:
                if not flags & ON_SSD:
                    n = i
                    break
                settled = False
            elif flags & PROMOTING:
                settled = False
            block.flags = flags | mark
        del found[n:]   # None cut off with the rest
        return Match(cast(list[Block], found), settled)

    def insert(self, key: bytes, parent: Block | None, offset: int) -> Block:
        """Add an unsealed block under ``parent`` (None = root); the key must be new."""
        assert key not in self._blocks, "insert of a key already present"
        assert parent is None or self._blocks.get(parent.key) is parent, "parent is not in the index"
        depth = 0 if parent is None else parent.depth + 1
        block = Block(key, parent, self, offset, _DEPTHS[depth] if depth < len(_DEPTHS) else depth)
        self._blocks[key] = block
        if parent is not None:
            parent.children += 1
        return block

    def chains(self) -> list[tuple[bytes, list[bytes]]]:
        """Every readable block as ``(parent key or b"", [keys])`` runs, each run a path down the
        tree, parents in earlier runs (or earlier in the same run) than their children; a run
        stops at a block that is not readable, with everything below it."""
        kids: dict[Block | None, list[Block]] = {}
        for block in self._blocks.values():
            if block.readable:
                kids.setdefault(block.parent, []).append(block)
        runs: list[tuple[bytes, list[bytes]]] = []
        todo: list[Block] = sorted(kids.get(None, ()), key=lambda b: b.key)
        while todo:
            block = todo.pop()
            run = [block.key]
            parent_key = block.parent.key if block.parent is not None else b""
            while True:
                below = sorted(kids.get(block, ()), key=lambda b: b.key)
                if not below:
                    break
                todo.extend(below[1:])
                block = below[0]
                run.append(block.key)
            runs.append((parent_key, run))
        return runs

    def remove(self, block: Block) -> None:
        """Remove a leaf (evicted, aborted or lost)."""
        assert block.children == 0, "removing an interior block would orphan its descendants"
        assert self._blocks.get(block.key) is block, "removing a block not in the index"
        del self._blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
        if self.observer is not None and block.flags & SEALED:   # (the unsealed were never readable)
            self.observer.set(self.namespace_id, block.key, 0)
