"""Engine buffers: the paged KV tensors clients register, and the copies between them and the
store (``save_blocks`` / ``load_blocks``), one engine block per block."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np

from kvstored.buffers import BlockIds, RegisteredBuffers, TensorSource
from kvstored.config import Config
from kvstored.copy import CopyEngine
from kvstored.handover import Arrival, Handover
from kvstored.index import Block, Tier
from kvstored.leases import Session
from kvstored.store.background import Background
from kvstored.store.catalog import Catalog, NamespaceState
from kvstored.store.leasing import Leasing
from kvstored.store.reads import Reads
from kvstored.store.reservations import Reservations
from kvstored_client.contract.errors import InvalidArgument, LeaseExpired, NotFound, Reason


def check_distinct(ids: np.ndarray, first: int = 0) -> None:
    """InvalidArgument naming two positions (counted from ``first``) that share an engine block:
    a save would store one block's bytes under the other's key, a load would overwrite one with
    the other."""
    if ids.size < 2:
        return
    ordered = np.sort(ids)   # finds out; the stable argsort (20x the cost at 16k ids) only names them
    if (ordered[1:] == ordered[:-1]).any():
        order = np.argsort(ids, kind="stable")
        repeats = np.flatnonzero(ids[order][1:] == ids[order][:-1])
        a, b = sorted((int(order[repeats[0]]), int(order[repeats[0] + 1])))
        raise InvalidArgument(f"block_ids[{first + a}] and block_ids[{first + b}] are both engine block "
                              f"{int(ids[a])}; each block needs its own")


def ignore_arrival(arrival: Arrival) -> None:
    """A handover whose reader learns nothing per block (a pull, a load's early copies)."""


class _EarlyCopy:
    """A load's copy of the blocks that come up from SSD during its lookup (``prefix_up``, given to
    ``Reads.lookup_chain``), through a :class:`Handover` made at the first of them; ``finish``
    waits for those and copies the rest, reporting tensors done only then; ``close`` always."""

    def __init__(self, copy: CopyEngine, buffers: RegisteredBuffers, block_ids: BlockIds,
                 copy_until: float | None) -> None:
        self._copy, self._buffers, self._block_ids, self._copy_until = copy, buffers, block_ids, copy_until
        self._handover: Handover | None = None
        self._given = 0

    def prefix_up(self, hits: list[Block], tiers: list[Tier], k: int) -> None:
        if self._handover is None:
            self._handover = Handover(ignore_arrival, self._copy, self._buffers, self._block_ids, self._copy_until)
        self._handover.give(self._given, hits[self._given:k], tiers[self._given:k])
        self._given = k

    async def finish(self, offsets: Sequence[int], tensor_done: Callable[[int], None] | None) -> None:
        """Copy the prefix whose slots are ``offsets`` (raises DeadlineExceeded like the copy)."""
        if self._handover is not None:
            await self._handover.finish()
        assert self._given <= len(offsets), f"{self._given} blocks copied early of a {len(offsets)}-block prefix"
        await self._copy.from_arena(self._buffers, self._block_ids[self._given:len(offsets)],
                                    offsets[self._given:], tensor_done, not_after=self._copy_until)

    async def close(self) -> None:
        if self._handover is not None:
            await self._handover.close()


class EngineBuffers:
    """Registered buffers by id, each owned by one session and registered for one namespace."""

    def __init__(self, config: Config, catalog: Catalog, leasing: Leasing, reservations: Reservations,
                 reads: Reads, copy: CopyEngine, background: Background) -> None:
        self._config = config
        self._catalog = catalog
        self._leasing = leasing
        self._reservations = reservations
        self._reads = reads
        self._copy = copy
        self._background = background
        self._buffers: dict[int, tuple[str, int, RegisteredBuffers]] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._buffers)

    def register(self, session: Session, state: NamespaceState, sources: Sequence[TensorSource]) -> RegisteredBuffers:
        """Map an engine's KV tensors; their block layout must match the namespace's."""
        buffers = RegisteredBuffers(self._next_id, self._config.dram.shm_dir, sources)
        try:
            if state.spec.layout and state.spec.layout != buffers.signature:
                raise InvalidArgument(f"buffers have layout {buffers.signature!r} but namespace "
                                      f"{state.spec.model!r} is {state.spec.layout!r}")
            self._catalog.fix_block_bytes(state, buffers.block_bytes)
        except BaseException:
            buffers.close()
            raise
        self._next_id += 1
        self._buffers[buffers.buffers_id] = (session.session_id, state.namespace_id, buffers)
        session.buffers.add(buffers.buffers_id)
        return buffers

    async def unregister(self, session: Session, buffers_id: int) -> None:
        """Stop using an engine's buffers. Returns once no copy touches them and they are unmapped
        (CUDA handles closed): only then may the engine free the memory."""
        buffers = self.owned(session.session_id, buffers_id)
        session.buffers.discard(buffers_id)
        del self._buffers[buffers_id]
        # A task of its own: a caller that goes away meanwhile (a request may hold the buffers
        # for a whole peer transfer) must not leave them mapped with nobody left to close them.
        await asyncio.shield(self._background.spawn(self._close_when_idle(buffers)))

    def drop(self, buffers_id: int) -> None:
        """Forget buffers whose session ended; they are closed once no copy uses them."""
        entry = self._buffers.pop(buffers_id, None)
        if entry is not None:
            if entry[2].busy:
                self._background.spawn(self._close_when_idle(entry[2]))
            else:
                entry[2].close()

    async def _close_when_idle(self, buffers: RegisteredBuffers) -> None:
        while buffers.busy:
            await asyncio.sleep(0.001)
        buffers.close()

    def owned(self, session_id: str, buffers_id: int, namespace_id: int | None = None) -> RegisteredBuffers:
        """The buffers ``buffers_id`` of this session (of this namespace, when given)."""
        entry = self._buffers.get(buffers_id)
        if entry is None or entry[0] != session_id:
            raise NotFound(f"unknown buffers {buffers_id} for this session", Reason.UNKNOWN_BUFFERS)
        if namespace_id is not None and entry[1] != namespace_id:
            raise InvalidArgument(f"buffers {buffers_id} were registered for another namespace")
        return entry[2]

    def check_block_ids(self, buffers: RegisteredBuffers, chain: Sequence[bytes],
                        block_ids: BlockIds, distinct: bool = True) -> None:
        """One id per block, each a block of ``buffers``, and (``distinct``) no id twice."""
        if len(block_ids) != len(chain):
            raise InvalidArgument(f"{len(block_ids)} block ids for {len(chain)} blocks")
        ids = np.asarray(block_ids)   # as the servicer passes them: no Python step per id
        if ids.size and (ids.min() < 0 or ids.max() >= buffers.num_blocks):
            i = next(i for i, b in enumerate(block_ids) if not 0 <= b < buffers.num_blocks)
            raise InvalidArgument(f"block_ids[{i}] = {block_ids[i]} out of range (buffers hold "
                                  f"{buffers.num_blocks} blocks)")
        if distinct:
            check_distinct(ids)

    async def save(self, session: Session, buffers: RegisteredBuffers, state: NamespaceState,
                   chain: list[bytes], block_ids: BlockIds, room_until: float) -> tuple[int, int]:
        """Copy the not-yet-cached blocks of a chain from engine buffers into the store, waiting
        for room until ``room_until`` (the event loop's time) when DRAM holds only blocks that
        must reach SSD first. Returns (already present, newly stored); stored may fall short when
        the tier is full.
        """
        leasing = self._leasing
        # The ids of blocks cached already are not used: an engine that no longer holds them may
        # name them all by one placeholder (vLLM's null block, say); those copied must differ.
        self.check_block_ids(buffers, chain, block_ids, distinct=False)
        with buffers.in_use():   # unregistering waits until the copy is done, a wait for room included
            lease = await self._reservations.reserve_chain_waiting(session, state, chain, room_until)
            present = len(lease.pinned)
            try:
                copied = np.asarray(block_ids[present: present + len(lease.new)])
                check_distinct(copied, first=present)
                if present and copied.size:
                    # a placeholder naming the cached prefix must never be copied: if the daemon lost
                    # part of that prefix meanwhile, the placeholder's bytes would be stored as a block
                    shared = np.intersect1d(copied, np.asarray(block_ids[:present]))
                    if shared.size:
                        i = present + int(np.flatnonzero(copied == shared[0])[0])
                        raise InvalidArgument(f"block_ids[{i}] = {int(shared[0])} also names a cached block "
                                              f"(a placeholder?), but block {i} is not cached here any more "
                                              "and would be copied from it; save again with its real id")
                await leasing.copying(lease, self._copy.to_arena(buffers, copied, [b.offset for b in lease.new]))
            except BaseException:
                leasing.end(lease, leasing.find_session(session.session_id), aborted=True)
                raise
            if leasing.doomed(lease.lease_id) or leasing.get(lease.lease_id) is None:
                leasing.finish_doomed(lease)
                raise LeaseExpired("session closed or reservation expired during the copy; nothing was stored",
                                   Reason.RESERVATION_EXPIRED)
            stored = len(lease.new)
            leasing.end(lease, session, aborted=False)
            return present, stored

    async def load(self, session: Session, buffers: RegisteredBuffers, state: NamespaceState,
                   chain: list[bytes], block_ids: BlockIds,
                   started: Callable[[list[Tier]], None] | None = None,
                   tensor_done: Callable[[int], None] | None = None,
                   copy_until: float | None = None) -> list[Tier]:
        """Copy the longest cached prefix of a chain into engine buffers; returns its tiers.

        ``started`` learns the tiers of the blocks about to be copied, ``tensor_done(i)`` when
        registered tensor ``i`` (a layer) is in place for all of them. ``copy_until``: the event
        loop's time (the caller's deadline) after which no layer's copy starts (DeadlineExceeded;
        see ``CopyEngine.from_arena``).
        """
        leasing = self._leasing
        self.check_block_ids(buffers, chain, block_ids)
        with buffers.in_use():   # unregistering waits for the lookup too, not only the copy
            # Blocks coming up from SSD are copied out as they land, while later ones are still
            # read; each is pinned by the handover until its copy is done.
            early = _EarlyCopy(self._copy, buffers, block_ids, copy_until)
            try:
                result = await self._reads.lookup_chain(state, chain, session, early.prefix_up)
                if started is not None:
                    started(result.tiers)
                if not result.blocks:
                    # its lease ended during the SSD reads: blocks copied before that are not
                    # reported, and no layer is reported done while such a copy still runs
                    await early.close()
                    if tensor_done is not None:
                        for i in range(len(buffers.tensors)):
                            tensor_done(i)
                    return []
                lease = leasing.get(result.lease_id)
                assert lease is not None, "a fresh lease vanished"
                try:
                    await leasing.copying(lease, early.finish(result.offsets, tensor_done))
                finally:
                    doomed = leasing.doomed(lease.lease_id)
                    leasing.finish_doomed(lease)
                    if not doomed and leasing.get(lease.lease_id) is not None:
                        leasing.end(lease, session, aborted=True)
                return result.tiers
            finally:
                await early.close()
