"""The global index: which node holds which blocks, in which tiers, fed by KV events.

Nodes are columns of a :class:`BlockTable`; a block's key there is its 64-bit hash (vLLM's int
form, or the last 8 bytes of a 32-byte key) mixed with its namespace id, so that two namespaces'
equal hashes (same tokens, another model or shard) stay apart. Tiers are bits: ``GPU`` (an
engine's own cache, from its vLLM events), ``CPU`` (a daemon's DRAM), ``DISK`` (its SSD).

The index applies batches as given; which batches to apply (order, gaps, epochs) is the
stream tracker's business (:mod:`kvstored.router.stream`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstored.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, hash64, medium_rank
from kvstored.router.table import BlockTable, Keys, Rows

GPU, CPU, DISK = 1, 2, 4
TIER_BITS = (GPU, CPU, DISK)          # by medium_rank
TIER_NAMES = {GPU: "gpu", CPU: "dram", DISK: "ssd"}


def namespace_mix(namespace_id: int) -> int:
    """A 64-bit mask of a namespace id (splitmix64), xor-ed into its blocks' keys."""
    z = (namespace_id + 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)


def hashes64(hashes: Sequence[int | bytes]) -> Keys:
    """Block hashes in either wire form as 64-bit ints (vectorized where they are all one kind:
    a 2,048-block prompt converted one by one costs half a millisecond). TypeError for anything
    but ints and byte strings (numpy would take floats and digit strings silently)."""
    if not hashes:
        return np.zeros(0, np.uint64)
    types = set(map(type, hashes))
    if types <= {int}:
        try:
            return np.asarray(hashes, np.uint64)
        except OverflowError:   # negative: signed int64s from a consumer that wrote them so
            pass
    elif types <= {bytes}:
        size = len(hashes[0])  # type: ignore[arg-type]
        joined = b"".join(hashes)  # type: ignore[arg-type]
        if size >= 8 and len(joined) == size * len(hashes):
            return np.frombuffer(joined, np.uint8).reshape(-1, size)[:, size - 8:].copy().view(">u8") \
                .astype(np.uint64).ravel()
    elif not types <= {int, bytes}:
        raise TypeError("block hashes are ints or byte strings")
    return np.fromiter((hash64(h) for h in hashes), np.uint64, len(hashes))


def index_keys(namespace_id: int, hashes: Sequence[int | bytes]) -> Keys:
    """The table keys of a chain's block hashes (either wire form) in ``namespace_id``."""
    return hashes64(hashes) ^ np.uint64(namespace_mix(namespace_id))


@dataclass(frozen=True, slots=True)
class Holdings:
    """What each node holds of one chain: ``nodes[i]`` holds ``prefix[i]`` leading blocks, of
    which ``gpu[i]``, ``dram[i]`` and ``ssd[i]`` are fastest in that tier."""

    nodes: tuple[str, ...]
    prefix: npt.NDArray[np.int64]
    gpu: npt.NDArray[np.int64]
    dram: npt.NDArray[np.int64]
    ssd: npt.NDArray[np.int64]
    blocks: int   # the chain's length


class GlobalIndex:
    """Sources and their blocks, answered per node. A source is a node id, or ``node/what`` for
    a second stream of the same node (its engine's GPU events): each has a column of its own, so
    that one stream's resync does not wipe the other's, and a node holds what any of its
    sources holds. Unknown sources get a column on first use; a dropped one's is emptied and
    reused."""

    def __init__(self, table: BlockTable | None = None) -> None:
        self._table = table or BlockTable()
        self._columns: dict[str, int] = {}
        self._free: list[int] = []
        self._mix_of: dict[int, int] = {}   # namespace id -> its mask (memoised: once per event otherwise)
        self._bit_of: dict[str, int] = {}   # medium -> tier bit
        self.applied_events = 0

    def sources(self) -> list[str]:
        return sorted(self._columns)

    def nodes(self) -> list[str]:
        return sorted({source.partition("/")[0] for source in self._columns})

    def _column(self, source: str) -> int:
        column = self._columns.get(source)
        if column is None:
            if self._free:
                column = self._free.pop()
            else:
                column = len(self._columns)
                if column >= self._table.columns:
                    self._table.add_columns(max(2 * self._table.columns, column + 1))
            self._columns[source] = column
        return column

    def clear(self, source: str) -> None:
        """Forget every block of ``source`` (a new epoch, AllBlocksCleared, before a snapshot)."""
        column = self._columns.get(source)
        if column is not None:
            self._table.clear_column(column)

    def drop(self, source: str) -> None:
        """Forget ``source`` altogether (its node's membership lease expired, it went silent)."""
        column = self._columns.pop(source, None)
        if column is not None:
            self._table.clear_column(column)
            self._free.append(column)

    def apply(self, source: str, events: Sequence[Event], namespace_id: int = 0) -> None:
        """Apply one batch from ``source`` in order; ``namespace_id`` for events that name none
        (a vLLM engine's). The last of several changes to the same (block, tier) wins, as it
        would one by one, so a batch is applied in a few vectorized steps."""
        column = self._column(source)
        start = 0
        for i, event in enumerate(events):
            if isinstance(event, AllBlocksCleared):
                self._apply_run(column, events[start:i], namespace_id)
                self._table.clear_column(column)
                start = i + 1
        self._apply_run(column, events[start:], namespace_id)
        self.applied_events += len(events)

    def _apply_run(self, column: int, events: Sequence[Event], default_ns: int) -> None:
        if not events:
            return
        hashes: list[int | bytes] = []
        mixes: list[int] = []
        counts: list[int] = []
        bits: list[int] = []
        ops: list[bool] = []
        mix_of, bit_of = self._mix_of, self._bit_of
        for event in events:
            kind = type(event)
            if kind is BlockStored or kind is BlockRemoved:
                block_hashes, medium, ns = event.block_hashes, event.medium, event.namespace_id  # type: ignore[union-attr]
                ns = default_ns if ns is None else ns
                hashes.extend(block_hashes)
                mix = mix_of.get(ns)
                if mix is None:
                    mix = mix_of[ns] = namespace_mix(ns)
                mixes.append(mix)
                counts.append(len(block_hashes))
                bit = bit_of.get(medium)
                if bit is None:
                    bit = bit_of[medium] = TIER_BITS[medium_rank(medium)]
                bits.append(bit)
                ops.append(kind is BlockStored)
        if not hashes:
            return
        n_per = np.asarray(counts, np.int64)
        raw = hashes64(hashes)
        keys = raw ^ np.repeat(np.asarray(mixes, np.uint64), n_per)
        key_bits = np.repeat(np.asarray(bits, np.uint8), n_per)
        key_ops = np.repeat(np.asarray(ops, bool), n_per)
        for bit in TIER_BITS:
            sel = np.flatnonzero(key_bits == bit)
            if not len(sel):
                continue
            if key_ops[sel].all():
                self._table.set_bits(keys[sel], column, bit)
                continue
            if not key_ops[sel].any():
                self._table.clear_bits(keys[sel], column, bit)
                continue
            # the last change of each key wins: unique over the reversed order
            rev = sel[::-1]
            _, last = np.unique(keys[rev], return_index=True)
            final = rev[last]
            self._table.set_bits(keys[final[key_ops[final]]], column, bit)
            self._table.clear_bits(keys[final[~key_ops[final]]], column, bit)

    def rows(self, namespace_id: int, hashes: Sequence[int | bytes] | Keys) -> tuple[list[str], Rows]:
        """The nodes (sorted) and, per block of the chain, each one's tier bits (its sources' together)."""
        if isinstance(hashes, np.ndarray):
            keys = hashes.astype(np.uint64, copy=False) ^ np.uint64(namespace_mix(namespace_id))
        else:
            keys = index_keys(namespace_id, hashes)
        rows = self._table.rows(keys)
        by_node: dict[str, list[int]] = {}
        for source, column in sorted(self._columns.items()):
            by_node.setdefault(source.partition("/")[0], []).append(column)
        nodes = sorted(by_node)
        if all(len(c) == 1 for c in by_node.values()):
            return nodes, rows[:, [by_node[n][0] for n in nodes]]
        merged = np.zeros((len(rows), len(nodes)), np.uint8)
        for i, node in enumerate(nodes):
            merged[:, i] = np.bitwise_or.reduce(rows[:, by_node[node]], axis=1)
        return nodes, merged

    def holdings(self, namespace_id: int, hashes: Sequence[int | bytes] | Keys) -> Holdings:
        """Per node, the leading blocks of the chain it holds and their fastest tiers."""
        nodes, rows = self.rows(namespace_id, hashes)
        length = len(rows)
        if not length or not nodes:
            zero = np.zeros(len(nodes), np.int64)
            return Holdings(tuple(nodes), zero, zero, zero, zero, length)
        held = rows != 0
        prefix = np.where(held.all(axis=0), length, held.argmin(axis=0)).astype(np.int64)
        rows = rows[:int(prefix.max())]   # nothing past the longest prefix counts
        inside = np.arange(len(rows))[:, None] < prefix[None, :]
        gpu = ((rows & GPU) != 0) & inside
        dram = ((rows & CPU) != 0) & inside & ~gpu
        g, d = gpu.sum(axis=0), dram.sum(axis=0)
        return Holdings(tuple(nodes), prefix, g, d, prefix - g - d, length)

    def entries(self) -> int:
        """(block, node) pairs held."""
        return self._table.entries()

    @property
    def nbytes(self) -> int:
        return self._table.nbytes
