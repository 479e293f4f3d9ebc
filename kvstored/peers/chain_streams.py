"""Streams: a chain's blocks handed over one by one, in order, as each is in place: the cached
prefix first (brought up from SSD as needed), then the rest fetched from the peers, each block
stored here and made visible the moment its checksum passed.

Built on the store's components (leasing, reservations, reads, promotion, placement, the
write-back); the blocks are received through a :data:`Fetcher` (``PeerNode.fetch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvstored.buffers import BlockIds
from kvstored.handover import Arrival, Handover
from kvstored.index import Block, Tier
from kvstored.leases import Lease, LeaseKind, Session
from kvstored.peers.connection import Into
from kvstored.store import BlockStore, KeyRequest, StreamEnd
from kvstored.store.catalog import NamespaceState
from kvstored.store.engine_buffers import ignore_arrival
from kvstored.store.reads import tiers_of
from kvstored.store.reservations import BLOCKED, FULL, HERE, RESERVED
from kvstored_client.contract.errors import (
    DaemonNotRunning,
    FailedPrecondition,
    InvalidArgument,
    Reason,
    ResourceExhausted,
)


@dataclass(frozen=True, slots=True)
class Fetched:
    """What a :data:`Fetcher` brought: ``delivered`` leading blocks, then ``stop`` and why."""

    delivered: int
    stop: str
    detail: str = ""


# fetcher(namespace_id, keys, into, landed): fetch ``keys`` in order from some peer; receive block i
# into ``into(i, length)``, then await ``landed(i, peer)``. Never raises for a peer's failure.
Landed = Callable[[int, str], Awaitable[None]]
Fetcher = Callable[[int, list[bytes], Into, Landed], Awaitable[Fetched]]

_STORED_HERE = "stored_here"   # _fill_reservation: go on from blocks another client stored meanwhile


class ChainStreamer:
    """Streams of one store's chains (see :meth:`stream_blocks`)."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    async def stream_blocks(self, session_id: str, namespace_id: int, keys: KeyRequest, buffers_id: int,
                            block_ids: BlockIds, emit: Callable[[Arrival], None] | None,
                            fetcher: Fetcher | None, on_lease: Callable[[int], None] | None = None,
                            copy_until: float | None = None) -> StreamEnd:
        """Hand a chain's blocks over one by one, in order, as each is in place: the cached prefix
        first, then (with ``fetcher``) the rest as a peer sends it, each block stored here and
        made visible the moment its checksum passed.

        With ``buffers_id`` each block is copied into ``block_ids[i]`` of those buffers before
        ``emit``; without, it is leased in the arena and the end names the lease (the caller
        releases it; ``on_lease`` learns that lease's id before the first ``emit``, for a caller
        that may stop listening before the end). With ``emit`` None (a pull) nothing is handed over: the blocks are only
        brought here, and nothing stays leased. A transfer that stops short keeps the complete
        blocks and drops the partial one; the end says why it stopped ("lease_ended": an arena
        reader released the lease on the local prefix while it came up from SSD; no peer is asked
        for blocks cached here). FailedPrecondition when the session closed while the local prefix
        came up (no peer is asked for the rest: nobody is left to take it). Raises the usual errors for
        bad input; with ``copy_until`` (the event loop's time: the caller's deadline),
        DeadlineExceeded when a copy into the engine's buffers would start after it (none does:
        the engine, told of the deadline, may be reusing those blocks).
        """
        session = self._store.leasing.working_session(session_id)
        buffers = self._store.buffers.owned(session_id, buffers_id, namespace_id) if buffers_id else None
        state, chain = self._store.catalog.resolve_keys(namespace_id, keys)
        if buffers is not None:
            self._store.buffers.check_block_ids(buffers, chain, block_ids)
        elif len(block_ids):
            # (they were ignored: the blocks went to the arena, none to the engine's buffers)
            raise InvalidArgument("block_ids name blocks of engine buffers: give buffers_id too, or no "
                                  "block_ids for a stream through the arena")
        ttl = self._store.config.leases.ttl_s
        with buffers.in_use() if buffers is not None else contextlib.nullcontext():
            pull = emit is None
            if emit is None:
                emit = ignore_arrival
                buffers = None
            handover = Handover(emit, self._store.copy, buffers, block_ids, copy_until) if buffers is not None \
                else Handover(emit)
            given = 0   # blocks of the local prefix handed over while the rest came up from SSD

            def prefix_up(hits: list[Block], tiers: list[Tier], k: int) -> None:
                nonlocal given
                handover.give(given, hits[given:k], tiers[given:k])
                given = k
            taken: list[int] = []   # the lookup's lease, busy from the start

            def lease_taken(lease_id: int) -> None:
                # Its first blocks go out while later ones still come up: an arena reader uses their
                # slots under this lease, which must not be reaped meanwhile (as a busy one is not);
                # nor may any stream's, whose end would otherwise stop short of blocks cached here.
                self._store.leasing.set_busy(lease_id)
                taken.append(lease_id)
                if on_lease is not None and buffers is None and not pull:
                    on_lease(lease_id)
            try:
                # The first blocks go out while later ones are read from SSD: into engine buffers
                # each is pinned by the handover until copied; an arena reader learns the lookup's
                # lease before its first block, and reads the blocks in their slots under it.
                local = await self._store.reads.lookup_chain(state, chain, session, prefix_up, lease_taken)
            except BaseException:
                self._drop_taken(taken, session)
                await handover.close()
                raise
            if taken and taken[0] != local.lease_id:   # the lookup let it go (nothing came up, or
                self._drop_taken(taken, session)       # its session closed): ended now
            if not self._store.leasing.has_session(session.session_id):
                # The client is gone (its session closed while the prefix came up): nobody to take
                # the rest, so no peer is asked for it and nothing more is leased.
                await handover.close()
                if self._store.leasing.stopping:
                    raise DaemonNotRunning("the daemon is stopping", Reason.DAEMON_STOPPING)
                raise FailedPrecondition(f"session {session_id!r} closed during the stream, after {given} "
                                         f"of {len(chain)} blocks had come up")
            read = self._store.leasing.get(local.lease_id) if local.lease_id else None
            if read is None:
                read = self._store.leasing.pin(session, LeaseKind.READ, namespace_id, [], ttl)
            reservation: Lease | None = None
            self._store.leasing.set_busy(read.lease_id)
            stop, detail = "complete", ""
            handed_lease = 0
            if on_lease is not None and buffers is None and not pull:
                on_lease(read.lease_id)   # the same, or (none leased by the lookup) the stream's own
            try:
                # the leased local prefix (none if the lease was reaped meanwhile: those handed
                # over early are in the engine's buffers all the same)
                handover.give(given, read.pinned[given:], local.tiers[given:])
                delivered = max(local.blocks, given)
                if delivered < len(chain) and local.lease_lost:
                    # Released by the arena reader while the prefix came up (busy, it is never
                    # reaped): the rest is cached here but no longer leased, and fetching it from a
                    # peer would be waste.
                    stop, detail = "lease_ended", (f"the reader released the lease on the cached prefix "
                                                   f"before block {delivered} was in DRAM")
                elif delivered < len(chain) and fetcher is None:
                    stop, detail = "missing", f"block {delivered} is not cached on this node"
                elif delivered < len(chain) and fetcher is not None:
                    reservation, delivered, stop, detail = await self._fetch_rest(
                        session, state, chain, read, delivered, handover, buffers is None and not pull, fetcher)
                await handover.finish()
                handed_lease = read.lease_id if buffers is None and read.pinned and not pull else 0
                if handed_lease:
                    self._store.leasing.renew(read, ttl)   # the reader's time starts now, not at the lookup
                return StreamEnd(delivered, len(chain), stop, detail, handed_lease, ttl)
            finally:
                try:
                    await handover.close()
                finally:   # also when cancelled again while close waits for a copy in flight
                    for lease in (reservation, read):
                        if lease is not None:   # the caller keeps only the lease it was handed
                            self._store.leasing.end_busy(lease, session, keep=lease.lease_id == handed_lease)

    def _drop_taken(self, taken: list[int], session: Session) -> None:
        """End the lease a stream's lookup took (busy since), if it still exists."""
        lease = self._store.leasing.get(taken[0]) if taken else None
        if lease is not None:
            self._store.leasing.end_busy(lease, session)
        elif taken:
            self._store.leasing.clear_busy(taken[0])

    async def _fetch_rest(self, session: Session, state: NamespaceState, chain: list[bytes], read: Lease,
                          delivered: int, handover: Handover, lease_arrivals: bool,
                          fetcher: Fetcher) -> tuple[Lease | None, int, str, str]:
        """Reserve the chain's missing blocks and let ``fetcher`` fill them in order; each block
        that lands is sealed, handed over (and with ``lease_arrivals`` leased in ``read``).
        Returns the reservation (still to be ended), how many blocks were handed over in all,
        and why it stopped."""
        if not state.spec.block_bytes:
            return None, delivered, "no_room", ("this node does not know the namespace's block size yet "
                                                "(give Namespace.block_bytes, or register buffers first)")
        reservation = self._store.reservations.reserve_present(session, state, chain)
        self._store.leasing.set_busy(reservation.lease_id)
        try:
            while True:
                _, delivered, stop, detail = await self._fill_reservation(
                    session, state, chain, read, reservation, delivered, handover, lease_arrivals, fetcher)
                if stop != _STORED_HERE:   # else: the next blocks are here now, then fetch the rest
                    return reservation, delivered, stop, detail
        except BaseException:
            # cancelled (the client left) or failed: stream_blocks never learns of the reservation,
            # which would stay busy, hence never reaped nor ended, for ever
            self._store.leasing.end_busy(reservation, session)
            raise

    async def _fill_reservation(self, session: Session, state: NamespaceState, chain: list[bytes], read: Lease,
                                reservation: Lease, delivered: int, handover: Handover, lease_arrivals: bool,
                                fetcher: Fetcher) -> tuple[Lease | None, int, str, str]:
        start = len(reservation.pinned)
        if start > delivered:   # another client stored blocks since our lookup: hand them over too
            extra = reservation.pinned[delivered:start]
            for block in extra:
                block.pins += 1
            read.pinned.extend(extra)
            tiers = tiers_of(extra)   # where they were found, as the lookup reports its own
            ready = await self._store.promotion.ensure_dram(extra)
            # a copy that failed its checksum left its block hollow; one still readable found no
            # DRAM slot (or its read failed and its SSD copy stays)
            corrupt = ready < len(extra) and not extra[ready].readable
            for block in extra[ready:]:
                block.pins -= 2          # the read lease's and the reservation's
            del read.pinned[len(read.pinned) - len(extra) + ready:]
            del reservation.pinned[delivered + ready:]
            for block in reversed(extra[ready:]):
                self._store.placement.remove_if_hollow(block)   # a copy that failed its checksum: a hollow leaf goes
            handover.give(delivered, extra[:ready], tiers[:ready])
            if corrupt:
                return reservation, delivered + ready, "corrupt", f"block {delivered + ready} could not be read here"
            if ready < len(extra):
                return reservation, delivered + ready, "no_room", (
                    f"block {delivered + ready} is on SSD here but could not be brought to DRAM: every block "
                    "that could make room is leased or being written (or the SSD read failed: see kvctl stats)")
            delivered = start
        if start == len(chain):
            return reservation, start, "complete", ""
        new = reservation.new
        block_bytes = state.spec.block_bytes
        sealed = 0
        here: int | None = None   # the block another client stored since the prefix was matched

        async def into(i: int, length: int) -> memoryview:
            nonlocal here
            # Slots are taken as blocks arrive, not up front: the first block of a long prompt
            # does not wait for thousands of reservations.
            if length != block_bytes:
                raise ValueError(f"peer sent block {start + i} of {length} bytes; expected {block_bytes}")
            assert i == len(new), "blocks must arrive in order"
            if start == 0 and i == 1:
                # The reader's first block goes out before the next one is received: while the
                # rest of a long prompt streams in, its copy and event would queue behind the
                # receiving (milliseconds on two cores). The sender fills the socket buffers
                # meanwhile, so the stream hardly pauses. (Here, not in ``landed``: block 0 is
                # counted as delivered by then, whatever happens while we wait.)
                await handover.settled()
            outcome = self._store.reservations.reserve_next(reservation, state, chain[start + i])
            for _ in range(3):
                # DRAM is full of this stream's own chain (a prompt larger than DRAM, each block
                # already in the engine's buffers): sink its oldest blocks to SSD and let them give
                # up their slots. The eviction policy cannot: they are interior blocks of a chain.
                # Its own blocks: the oldest DRAM-only blocks of the namespace may be another
                # client's, leased, whose slots writing them back does not free.
                if outcome != FULL or self._store.ssd_tier is None:
                    break
                await self._store.writeback.write_back(8 * block_bytes, True, {state.namespace_id}, among=new[:i])
                await handover.settled()   # blocks still being copied to the engine are pinned till then
                if not self._store.placement.drop_clean_slots(new[:i], 8):
                    break
                outcome = self._store.reservations.reserve_next(reservation, state, chain[start + i])
            if outcome == HERE:
                here = i
                raise ResourceExhausted(f"block {start + i} was stored here meanwhile by another client")
            if outcome != RESERVED:
                raise ResourceExhausted(f"no DRAM slot for block {start + i}: " + (
                    "another client is writing it" if outcome == BLOCKED else "every block that could "
                    "make room is leased or being written"))
            return self._store.arena.view(new[i].offset, length).data

        async def landed(i: int, peer: str) -> None:
            nonlocal sealed
            assert i == sealed, "blocks must land in order"
            block = new[i]
            # Stored now. The reservation's pin moves down the chain: the block the next one
            # will hang under stays pinned (an unpinned DRAM-only leaf is another client's first
            # victim, and the next block would be reserved under a block gone from the index).
            if i:
                new[i - 1].pins -= 1
            self._store.placement.sealed_now([block])
            if lease_arrivals:
                block.pins += 1
                read.pinned.append(block)
            sealed += 1
            self._store.peer_traffic.fetched += 1
            handover.give(start + i, [block], [Tier.PEER], peer)

        ours: list[Block] = []
        try:
            got = await fetcher(state.namespace_id, chain[start:], into, landed)
        finally:
            if sealed:
                new[sealed - 1].pins -= 1   # the reservation's pin on the last block stored
            ours = new[:sealed]
            del new[:sealed]             # sealed blocks are no longer the reservation's to abort
        if here is not None and here == sealed and not new:
            # Another client stored the next blocks while the peers were asked (a second request
            # for the same prompt, say): they are cached here, not being written. The reservation
            # takes our blocks and those as its prefix, hands them over, then fetches what follows.
            found = state.index.match(chain[start + sealed:])
            if found:
                for block in ours + found:
                    block.pins += 1
                reservation.pinned.extend(ours + found)
                return reservation, start + sealed, _STORED_HERE, ""
        return reservation, start + sealed, got.stop, got.detail

