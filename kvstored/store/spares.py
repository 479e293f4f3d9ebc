"""Spare slots: DRAM slots a session holds bound to no block, which its saves copy rows into
before naming the blocks, so that a save is one call (a commit) instead of a reservation, the
copy and a seal."""

from __future__ import annotations

from collections.abc import Sequence

from kvstored.index import NO_SLOT, PROMOTING, Block
from kvstored.store.catalog import NamespaceState
from kvstored.store.placement import Placement
from kvstored.store.quarantine import Quarantine
from kvstored_client.contract.errors import InvalidArgument


class Spares:
    """Each session's spare slots by slot size. A spare slot is used DRAM that no block holds
    (the page holding it cannot be emptied) until a commit binds a block to it or the session
    ends; a session holds at most ``limit_bytes`` of them, all sessions together (with those in
    quarantine) at most ``total_bytes`` (the sessions past it save by reservations until others
    give theirs up).

    The slots of an ended session go to ``quarantine`` before they are free: its client learns
    of the end after the daemon, and a save of one of its threads may be copying rows into them
    meanwhile (a close from another thread, a broken session stream)."""

    def __init__(self, placement: Placement, limit_bytes: int, total_bytes: int, quarantine: Quarantine) -> None:
        self._placement = placement
        self.limit_bytes = limit_bytes
        self.total_bytes = total_bytes
        self.held_bytes = 0            # over all sessions
        self.quarantine = quarantine   # of ended sessions, not free yet
        self._held: dict[str, dict[int, set[int]]] = {}   # session id -> slot bytes -> offsets

    def top_up(self, session_id: str, slot_bytes: int, wanted: int) -> list[int]:
        """Allocate spare slots of ``slot_bytes`` (making room as a reservation does) until the
        session holds ``wanted`` of them or its limit; the new ones' offsets, ascending. Fewer
        when the tier cannot make room now."""
        self.quarantine.release_due()
        sizes = self._held.setdefault(session_id, {})
        offsets = sizes.setdefault(slot_bytes, set())
        room = min(self.limit_bytes - sum(sb * len(o) for sb, o in sizes.items()),
                   self.total_bytes - self.held_bytes - self.quarantine.bytes) // slot_bytes
        new: list[int] = []
        for _ in range(max(0, min(wanted - len(offsets), room))):
            offset = self._placement.alloc(slot_bytes)
            if offset is None:
                break
            new.append(offset)
        offsets.update(new)
        self.held_bytes += slot_bytes * len(new)
        new.sort()
        return new

    def commit(self, session_id: str, state: NamespaceState, chain: Sequence[bytes], first: int,
               offsets: Sequence[int]) -> tuple[int, int, list[int]]:
        """Store the blocks of ``chain`` from ``first`` on whose rows the session copied into its
        spare slots ``offsets`` (one per block, in chain order): each block not cached yet takes
        its row's slot, sealed at once. Returns (blocks cached before, blocks stored, the slots of
        rows not used, which stay spare, ascending). Nothing is stored when a block before
        ``first`` is not cached (the rows for it were not given) or from the first block of the
        rest that is cached or that another writer holds unsealed (a block whose bytes were lost
        is written again). InvalidArgument for offsets that are not the session's spares of the
        namespace's slot size."""
        if not 0 <= first <= len(chain) or len(offsets) != len(chain) - first:
            raise InvalidArgument(f"{len(offsets)} spare slots for blocks {first}.. of a chain of {len(chain)}")
        sb = state.index.slot_bytes
        held = self._held.get(session_id, {}).get(sb, set())
        given = set(offsets)
        if len(given) != len(offsets) or not given <= held:
            raise InvalidArgument("offsets name slots that are not this session's spare slots of "
                                  f"{sb} bytes (or name one twice)")
        placement, index = self._placement, state.index
        placement.dram.advance()
        present = index.match(chain)
        # Not a hit for the policies (a save after its lookup, as a reservation's); pages in use.
        placement.dram.mark_pages(present)
        stored: list[Block] = []
        if len(present) >= first:
            parent = present[-1] if present else None
            for i in range(len(present), len(chain)):
                existing = index.get(chain[i])
                if existing is None:
                    block = placement.bind(index.insert(chain[i], parent, NO_SLOT), offsets[i - first])
                    block.pins = 0   # (a block is inserted pinned, by its writer: its bytes are here)
                elif existing.sealed and not existing.readable and existing.pins == 0 \
                        and not existing.flags & PROMOTING:
                    # hollow (its bytes were lost, its children kept): written again in place, as a
                    # reservation would; unsealed before it has the slot (see Placement.bind)
                    existing.flags = 0
                    index.changed(existing)
                    block = placement.bind(existing, offsets[i - first])
                    block.check = None
                else:   # cached since (its row is not needed), or another client is writing it
                    break
                stored.append(block)
                parent = block
        held.difference_update(b.offset for b in stored)
        self.held_bytes -= sb * len(stored)
        placement.sealed_now(stored)
        unused = sorted(given & held)
        return len(present), len(stored), unused

    def drop(self, session_id: str) -> None:
        """The session ended: its spare slots are free again once their quarantine is over."""
        for slot_bytes, offsets in self._held.pop(session_id, {}).items():
            self.held_bytes -= slot_bytes * len(offsets)
            self.quarantine.hold(slot_bytes, offsets)
        self.quarantine.release_due()
