"""The block table: for each 64-bit block key, a byte of tier bits per node column.

An open-addressed hash table in two numpy arrays (keys, and a row of ``columns`` bytes per slot),
so that an entry costs its 8-byte key and a byte per column at a load of at most 0.7, not the
hundred-odd bytes of a Python dict entry with its int objects; and so that a prompt's 2,048 keys
are looked up in a handful of vectorized probes. Key 0 marks an empty slot (a real key of 0 is
stored as 1: one in 2^64). A slot whose bits all went to zero keeps its key until the table is
rebuilt (it only lengthens probes), which happens when it grows or when such slots pile up.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Keys = npt.NDArray[np.uint64]
Rows = npt.NDArray[np.uint8]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MAX_LOAD = 0.7


class BlockTable:
    """Tier bits per (key, column). Keys are uint64 arrays; bits are 0..255 per column."""

    def __init__(self, columns: int = 8, capacity: int = 1 << 12) -> None:
        capacity = 1 << max(4, (capacity - 1).bit_length())
        self._keys: Keys = np.zeros(capacity, np.uint64)
        self._bits: Rows = np.zeros((capacity, columns), np.uint8)
        self._used = 0   # slots with a key (live or emptied)

    @property
    def columns(self) -> int:
        return int(self._bits.shape[1])

    @property
    def capacity(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._bits.nbytes)

    def entries(self) -> int:
        """(key, column) pairs with a bit set."""
        return int(np.count_nonzero(self._bits))

    def blocks(self) -> int:
        """Keys with a bit set in some column."""
        return int(np.count_nonzero(self._bits.any(axis=1)))

    def add_columns(self, columns: int) -> None:
        """Widen every row to ``columns`` (new columns empty)."""
        if columns > self.columns:
            wider = np.zeros((self.capacity, columns), np.uint8)
            wider[:, :self.columns] = self._bits
            self._bits = wider

    def _home(self, keys: Keys, capacity: int) -> npt.NDArray[np.int64]:
        shift = np.uint64(64 - (capacity.bit_length() - 1))
        return ((keys * _GOLDEN) >> shift).astype(np.int64)

    def find(self, keys: Keys) -> npt.NDArray[np.int64]:
        """The slot of each key, -1 where it has none."""
        keys = np.where(keys == 0, np.uint64(1), keys)
        out = np.full(len(keys), -1, np.int64)
        mask = self.capacity - 1
        todo = np.arange(len(keys))
        pos = self._home(keys, self.capacity)
        table = self._keys
        for _ in range(self.capacity):
            if not len(todo):
                break
            k = table[pos]
            want = keys[todo]
            hit = k == want
            out[todo[hit]] = pos[hit]
            go_on = ~hit & (k != 0)
            todo, pos = todo[go_on], (pos[go_on] + 1) & mask
        return out

    def rows(self, keys: Keys) -> Rows:
        """Each key's row of tier bits (zeros for a key not in the table)."""
        slots = self.find(keys)
        rows = self._bits[np.maximum(slots, 0)]
        rows[slots < 0] = 0
        return rows

    def set_bits(self, keys: Keys, column: int, bit: int) -> None:
        """Set ``bit`` in ``column`` for every key (inserting the keys missing)."""
        if len(keys):
            slots = self._insert(np.unique(np.where(keys == 0, np.uint64(1), keys)))
            self._bits[slots, column] |= np.uint8(bit)

    def clear_bits(self, keys: Keys, column: int, bit: int) -> None:
        """Clear ``bit`` in ``column`` for every key present."""
        if len(keys):
            slots = self.find(keys)
            slots = slots[slots >= 0]
            self._bits[slots, column] &= np.uint8(~bit & 0xFF)

    def clear_column(self, column: int) -> None:
        self._bits[:, column] = 0
        self._maybe_rebuild(0)

    def _insert(self, keys: Keys) -> npt.NDArray[np.int64]:
        """Slots of unique nonzero ``keys``, inserting the missing ones."""
        slots = self.find(keys)
        new = np.flatnonzero(slots < 0)
        if not len(new):
            return slots
        if self._maybe_rebuild(len(new)):   # every slot moved
            slots = self.find(keys)
            new = np.flatnonzero(slots < 0)
        mask = self.capacity - 1
        todo = new
        pos = self._home(keys[todo], self.capacity)
        for _ in range(self.capacity):
            if not len(todo):
                break
            free = self._keys[pos] == 0
            # several new keys may reach the same free slot in one step: the first takes it
            cand, first = np.unique(pos[free], return_index=True)
            winners = np.flatnonzero(free)[first]
            self._keys[cand] = keys[todo[winners]]
            slots[todo[winners]] = cand
            rest = np.ones(len(todo), bool)
            rest[winners] = False
            todo, pos = todo[rest], (pos[rest] + 1) & mask
        self._used += len(new)
        return slots

    def _maybe_rebuild(self, adding: int) -> bool:
        """Rebuild with the live keys only, grown so that they and ``adding`` more fill at most
        half of MAX_LOAD, when ``adding`` would pass MAX_LOAD; whether it did."""
        if self._used + adding <= MAX_LOAD * self.capacity:
            return False
        live = self._bits.any(axis=1)
        keys, bits = self._keys[live], self._bits[live]
        capacity = self.capacity
        while len(keys) + adding > MAX_LOAD / 2 * capacity:
            capacity *= 2
        self._keys = np.zeros(capacity, np.uint64)
        self._bits = np.zeros((capacity, bits.shape[1]), np.uint8)
        self._used = 0
        if len(keys):
            self._bits[self._insert(keys)] = bits
        return True
