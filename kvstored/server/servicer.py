"""The KVStore servicer: protobuf in, one domain call, protobuf out."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Protocol, TypeVar

import grpc
import numpy as np

from kvstored.buffers import BlockIds, TensorSource
from kvstored.handover import Arrival
from kvstored.index import Tier
from kvstored.peers.chain_streams import ChainStreamer, Fetcher
from kvstored.peers.node import MigrateProgress, PeerNode
from kvstored.server.status import abort, mapped
from kvstored.server.streams import RunningStreams
from kvstored.store import BlockStore, FlushProgress, KeyRequest, StreamEnd
from kvstored.tiers.dram import Arena
from kvstored_client import __version__
from kvstored_client.contract.errors import Cancelled, FailedPrecondition, InvalidArgument, KVStoreError, Reason
from kvstored_client.contract.layout import TensorLayout
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc
from kvstored_client.contract.wire import namespace_from_pb, namespace_to_pb

log = logging.getLogger("kvstored.server")
# After a stream's first block (sent at once), later blocks are gathered for a tenth of the time
# the stream has run, within these bounds: a long stream costs the client, and this daemon, a
# message per many blocks instead of per block, while a short one is not held back.
STREAM_GATHER_MIN_S = 0.001
STREAM_GATHER_MAX_S = 0.008
# A peer transfer ends this long (at most a tenth of the call's time) before the caller's
# deadline, so that its outcome (a short stream, "timeout") reaches the caller rather than
# DEADLINE_EXCEEDED: with the defaults, peers.deadline_s and the SDK's timeout_s are both 30 s.
STREAM_END_MARGIN_S = 1.0
HEARTBEAT_S = 5.0   # the latest progress of a migration or a flush is sent again at least this often
P = TypeVar("P")
M = TypeVar("M")
_TIER_PB = {Tier.DRAM: pb.TIER_DRAM, Tier.SSD: pb.TIER_SSD, Tier.PEER: pb.TIER_PEER}
_TIER_FROM_PB = {pb.TIER_UNSPECIFIED: None, pb.TIER_DRAM: Tier.DRAM, pb.TIER_SSD: Tier.SSD}


def _tiers_pb(tiers: list[Tier]) -> list[pb.Tier]:
    if tiers and tiers.count(tiers[0]) == len(tiers):
        return [_TIER_PB[tiers[0]]] * len(tiers)
    return [_TIER_PB[t] for t in tiers]


class CallContext(Protocol):
    """What the unary handlers ask of their call: gRPC's context, or the fast path's
    (kvstored/server/fast_path.py), which serves the same handlers."""

    def time_remaining(self) -> float | None: ...


def _tiers_packed(tiers: list[Tier]) -> bytes:
    """``tiers`` as LookupResponse.packed_tiers: one byte per block."""
    if tiers and tiers.count(tiers[0]) == len(tiers):
        return bytes((_TIER_PB[tiers[0]],)) * len(tiers)
    return bytes(_TIER_PB[t] for t in tiers)


def _deadline(context: CallContext) -> float | None:
    """The call's deadline on the event loop's clock (None: it has none). The client's own
    deadline passes a little before this one (the request's way over), or long before it when
    the daemon read the request late (frozen, starved)."""
    remaining = context.time_remaining()
    return None if remaining is None else asyncio.get_running_loop().time() + remaining


def _answer_by(context: CallContext) -> float | None:
    """When (the event loop's time) a call that may wait should stop waiting so that its answer
    reaches the client before its deadline: STREAM_END_MARGIN_S (or a tenth of the time left)
    before it; None without a deadline."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + remaining - min(STREAM_END_MARGIN_S, remaining / 10)


def _keys(msg: pb.BlockKeys) -> KeyRequest:
    return KeyRequest(list(msg.hashes), msg.token_ids, msg.cache_salt, msg.lora_name, msg.packed_hashes)


def _block_ids(request: pb.SaveBlocksRequest | pb.LoadBlocksRequest | pb.StreamBlocksRequest) -> BlockIds:
    """The request's block ids, from ``block_ids`` or ``packed_block_ids`` (little-endian uint32s),
    as an array (numpy reads either without a Python step per id)."""
    packed = request.packed_block_ids
    if packed and len(request.block_ids):
        raise InvalidArgument("give block_ids or packed_block_ids, not both")
    if len(packed) % 4:
        raise InvalidArgument(f"packed_block_ids has {len(packed)} bytes, not a whole number of uint32s")
    return np.frombuffer(packed, "<u4") if packed else np.asarray(request.block_ids, dtype=np.uint32)


def _tensor(i: int, msg: pb.TensorDesc) -> TensorSource:
    if len(msg.shape) != len(msg.strides):
        raise InvalidArgument(f"tensors[{i}]: shape and strides differ in length")
    return TensorSource(msg.shm_name, msg.offset,
                        TensorLayout(tuple(msg.shape), tuple(msg.strides), msg.dtype, msg.block_dim),
                        msg.cuda_ipc_handle, msg.device_uuid)


def _migrate_pb(p: MigrateProgress) -> pb.MigrateProgress:
    return pb.MigrateProgress(total_blocks=p.total, pushed_blocks=p.pushed, failed_blocks=p.failed,
                              dropped_blocks=p.dropped, detail=p.detail, done=p.done)


def _flush_pb(p: FlushProgress) -> pb.FlushProgress:
    return pb.FlushProgress(written_blocks=p.written, left_blocks=p.left, done=p.done)


async def _with_heartbeat(progress: AsyncGenerator[P, None], message: Callable[[P], M]) -> AsyncIterator[M]:
    """``progress`` as messages, the latest sent again whenever nothing new came for HEARTBEAT_S:
    a long step (pushing a chain, writing a round to SSD) must not look like a stuck daemon to a
    client that gives up after a silence. ``progress`` is closed at the end, and when the call is
    cancelled (its step cancelled first)."""
    latest: M | None = None

    def next_step() -> asyncio.Future[P]:
        step = asyncio.ensure_future(anext(progress))
        # Its exception (StopAsyncIteration at the end, or the error) counts as retrieved at once:
        # a step that ends in the turn the call is cancelled, or while a cancelled call's
        # generator waits to be finalized after a heartbeat, is never read, and asyncio logged
        # "Task exception was never retrieved" with a traceback, as if the daemon had crashed.
        step.add_done_callback(lambda f: f.cancelled() or f.exception())
        return step

    step = next_step()
    try:
        while True:
            await asyncio.wait((step,), timeout=HEARTBEAT_S)
            if not step.done():
                if latest is not None:
                    yield latest
                continue
            try:
                p = step.result()
            except StopAsyncIteration:
                return
            latest = message(p)
            yield latest
            step = next_step()
    finally:
        if not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step
        await progress.aclose()


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """The daemon's gRPC service. The hot unary handlers (kvstored_client.contract.frames.METHODS)
    are also the fast path's: they ask their context only for the time left."""

    def __init__(self, store: BlockStore, arena: Arena, lease_ttl_s: float, max_batch_blocks: int,
                 shutting_down: asyncio.Event, peers: PeerNode | None = None,
                 streamer: ChainStreamer | None = None, fast_socket: str = "") -> None:
        self._store = store
        self._fast_socket = fast_socket
        # the table is named only beside the fast socket: its lookups tell the daemon of their hits there
        presence = store.presence if fast_socket else None
        self._presence_path = str(presence.path) if presence is not None else ""
        self._instance_id = presence.instance_id if presence is not None else 0
        self._streamer = streamer if streamer is not None else ChainStreamer(store)
        self._peers = peers
        self._arena = arena
        self._lease_ttl_ms = int(lease_ttl_s * 1000)
        self._max_batch = max_batch_blocks
        self._shutting_down = shutting_down
        self._streams = RunningStreams()

    @mapped
    async def Hello(self, request: pb.HelloRequest, context: grpc.aio.ServicerContext) -> pb.HelloResponse:
        return pb.HelloResponse(version=__version__, arena_path=str(self._arena.path),
                                arena_bytes=self._arena.capacity, lease_ttl_ms=self._lease_ttl_ms,
                                max_batch_blocks=self._max_batch, packed_keys=True, end_stream=True,
                                fast_socket=self._fast_socket, presence_table=self._presence_path,
                                instance_id=self._instance_id)

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        session = self._store.open_session(first.client_name, first.pid)
        # (the name is the client's to choose: quoted and cut, it can neither forge a line nor fill the log)
        log.info("session %s opened by %.80r (pid %d)", session.session_id[:8], first.client_name, first.pid)
        closing = asyncio.ensure_future(self._shutting_down.wait())
        reader: asyncio.Future[object] | None = None
        try:
            await context.write(pb.SessionEvent(session_id=session.session_id, arena_path=str(self._arena.path),
                                                arena_bytes=self._arena.capacity, packed_keys=True,
                                                end_stream=True, spare_bytes=self._store.spare_bytes))
            while True:
                reader = asyncio.ensure_future(context.read())
                done, _ = await asyncio.wait({reader, closing}, return_when=asyncio.FIRST_COMPLETED)
                if closing in done:
                    await context.write(pb.SessionEvent(session_id=session.session_id, closing=True))
                    break
                if reader.result() is grpc.aio.EOF:
                    break
                # A later message carries nothing: the session lasts until the client ends its
                # side of the stream or goes away (ending the session here dropped its leases,
                # reservations and buffers under a client that was still using them).
        finally:
            # Client closed, died (the RPC is cancelled) or the daemon is stopping. Cancelled,
            # the wait above leaves both tasks pending: the one on the shutdown event would stay
            # for the daemon's lifetime, one for every client that ever went away.
            for task in (reader, closing):
                if task is not None:
                    task.cancel()
            self._store.close_session(session.session_id)
            self._streams.forget(session.session_id)
            log.info("session %s closed", session.session_id[:8])

    @mapped
    async def OpenNamespace(self, request: pb.OpenNamespaceRequest,
                            context: grpc.aio.ServicerContext) -> pb.OpenNamespaceResponse:
        state = self._store.open_namespace(namespace_from_pb(request.spec))
        return pb.OpenNamespaceResponse(namespace_id=state.namespace_id, spec=namespace_to_pb(state.spec))

    @mapped
    async def Lookup(self, request: pb.LookupRequest, context: CallContext) -> pb.LookupResponse:
        if request.peers and request.lease:
            raise InvalidArgument("a lookup cannot both lease and ask peers; stream the blocks instead")
        holders: dict[str, int] = {}
        if request.peers and self._peers is not None:
            r, holders = await self._peers.lookup(request.namespace_id, _keys(request.keys))
        else:
            r = await self._store.lookup(request.namespace_id, _keys(request.keys), request.lease,
                                         request.session_id, request.prompt_blocks)
        best = max(holders.values(), default=0)
        reply = pb.LookupResponse(hit_blocks=r.blocks + best, lease_id=r.lease_id,
                                  lease_ttl_ms=int(r.lease_ttl_s * 1000), block_bytes=r.block_bytes,
                                  block_size=r.block_size,
                                  peer_hits=[pb.PeerHit(node_id=n, blocks=c) for n, c in sorted(holders.items())])
        tiers = r.tiers + [Tier.PEER] * best if best else r.tiers
        if request.packed_reply:   # a long prefix's fields without a protobuf step per block
            reply.packed_tiers = _tiers_packed(tiers)
            if r.offsets:
                reply.packed_offsets = np.asarray(r.offsets, dtype="<u8").tobytes()
        else:
            reply.tiers.extend(_tiers_pb(tiers))
            reply.offsets.extend(r.offsets)
        return reply

    @mapped
    async def Reserve(self, request: pb.ReserveRequest, context: CallContext) -> pb.ReserveResponse:
        r = await self._store.reserve_waiting(request.session_id, request.namespace_id, _keys(request.keys),
                                              request.block_bytes, _answer_by(context))
        return pb.ReserveResponse(reservation_id=r.reservation_id, present_blocks=r.present,
                                  offsets=r.offsets, ttl_ms=int(r.ttl_s * 1000))

    def _push_target(self, node_id: str) -> PeerNode | None:
        if not node_id:
            return None
        if self._peers is None:
            raise FailedPrecondition("peers are off on this node (configure peers.listen / peers.static / peers.etcd)",
                                     Reason.PEERS_OFF)
        self._peers.check_peer(node_id)
        return self._peers

    @mapped
    async def Seal(self, request: pb.SealRequest, context: CallContext) -> pb.SealResponse:
        try:
            peers = self._push_target(request.push_to)
        except KVStoreError:
            # The save fails as a whole: give its reservation back, or the blocks written into
            # it stay unsealed (slots held, every other writer of the prefix blocked) until it
            # expires. (The SDK releases it too, in the background: a second release is a no-op.
            # Only a reservation: the id of one of the session's read leases leaves it alone.)
            with contextlib.suppress(KVStoreError):
                self._store.release(request.session_id, request.reservation_id, reservation_only=True)
            raise
        namespace_id, chain = self._store.reservation_chain(request.session_id, request.reservation_id)
        sealed = self._store.seal(request.session_id, request.reservation_id)
        if peers is not None:
            peers.push_later(request.push_to, namespace_id, chain)
        return pb.SealResponse(sealed_blocks=sealed)

    @mapped
    async def Commit(self, request: pb.CommitRequest, context: CallContext) -> pb.CommitResponse:
        c = self._store.commit(request.session_id, request.namespace_id, _keys(request.keys), request.first,
                               request.offsets, request.block_bytes, request.spares_wanted)
        return pb.CommitResponse(present_blocks=c.present, stored_blocks=c.stored, spare_offsets=c.spare_offsets)

    @mapped
    async def Release(self, request: pb.ReleaseRequest, context: CallContext) -> pb.ReleaseResponse:
        self._store.release(request.session_id, request.lease_id)
        return pb.ReleaseResponse()

    @mapped
    async def RegisterBuffers(self, request: pb.RegisterBuffersRequest,
                              context: grpc.aio.ServicerContext) -> pb.RegisterBuffersResponse:
        sources = [_tensor(i, t) for i, t in enumerate(request.tensors)]
        b = self._store.register_buffers(request.session_id, request.namespace_id, sources)
        return pb.RegisterBuffersResponse(buffers_id=b.buffers_id, num_blocks=b.num_blocks,
                                          block_bytes=b.block_bytes, layout=b.signature)

    @mapped
    async def UnregisterBuffers(self, request: pb.UnregisterBuffersRequest,
                                context: grpc.aio.ServicerContext) -> pb.UnregisterBuffersResponse:
        await self._store.unregister_buffers(request.session_id, request.buffers_id)
        return pb.UnregisterBuffersResponse()

    @mapped
    async def SaveBlocks(self, request: pb.SaveBlocksRequest,
                         context: CallContext) -> pb.SaveBlocksResponse:
        peers = self._push_target(request.push_to)
        keys = _keys(request.keys)
        if peers is not None:   # the chain is needed twice: token ids are hashed once
            _, chain = self._store.resolve_keys(request.namespace_id, keys)
            keys = KeyRequest(hashes=chain)
        present, stored = await self._store.save_blocks(
            request.session_id, request.namespace_id, request.buffers_id, keys, _block_ids(request),
            _answer_by(context))
        if peers is not None:
            peers.push_later(request.push_to, request.namespace_id, chain[: present + stored])
        return pb.SaveBlocksResponse(present_blocks=present, stored_blocks=stored)

    @mapped
    async def LoadBlocks(self, request: pb.LoadBlocksRequest,
                         context: CallContext) -> pb.LoadBlocksResponse:
        tiers = await self._store.load_blocks(request.session_id, request.namespace_id,
                                              request.buffers_id, _keys(request.keys), _block_ids(request),
                                              copy_until=_deadline(context))
        return pb.LoadBlocksResponse(loaded_blocks=len(tiers), tiers=_tiers_pb(tiers))

    async def LoadBlocksStream(self, request: pb.LoadBlocksRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LoadEvent]:
        events: asyncio.Queue[pb.LoadEvent] = asyncio.Queue()
        deadline = _deadline(context)

        def started(tiers: list[Tier]) -> None:
            events.put_nowait(pb.LoadEvent(started=pb.LoadBlocksResponse(
                loaded_blocks=len(tiers), tiers=_tiers_pb(tiers))))

        async def run() -> None:
            try:
                await self._store.load_blocks(
                    request.session_id, request.namespace_id, request.buffers_id, _keys(request.keys),
                    _block_ids(request), started=started,
                    tensor_done=lambda i: events.put_nowait(pb.LoadEvent(tensor_done=i)), copy_until=deadline)
            finally:
                events.put_nowait(pb.LoadEvent(done=True))

        task = asyncio.ensure_future(run())
        # a client gone in the turn its load failed leaves the error to nobody: retrieved here
        task.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            while True:
                event = await events.get()
                if event.WhichOneof("event") == "done":
                    break
                yield event
            await task  # raises the domain error, if any
        except KVStoreError as exc:
            await abort(context, exc)
        finally:
            if not task.done():
                task.cancel()
                # (as StreamBlocks does: its clean-up runs now, and an error in it is not lost)
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        yield pb.LoadEvent(done=True)

    async def StreamBlocks(self, request: pb.StreamBlocksRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.BlockEvent]:
        events: asyncio.Queue[Arrival | StreamEnd | Exception] = asyncio.Queue()
        deadline = _deadline(context)
        lease_id = 0   # told to the client in the first event: it may leave before the end

        def on_lease(lease: int) -> None:
            nonlocal lease_id
            lease_id = lease

        async def run() -> None:
            try:
                fetcher: Fetcher | None = None
                if request.peers and self._peers is not None:
                    fetcher = self._peers.fetch
                    remaining = context.time_remaining()
                    if remaining is not None:
                        until = asyncio.get_running_loop().time() + remaining \
                            - min(STREAM_END_MARGIN_S, remaining / 10)
                        fetcher = functools.partial(self._peers.fetch, until=until)
                events.put_nowait(await self._streamer.stream_blocks(
                    request.session_id, request.namespace_id, _keys(request.keys), request.buffers_id,
                    _block_ids(request), None if request.end_only else events.put_nowait, fetcher, on_lease,
                    copy_until=deadline))
            except Exception as exc:   # handed to the response loop, which ends the call with it
                events.put_nowait(exc)
            except asyncio.CancelledError:   # EndStream (or the call's end): the loop must not wait on
                events.put_nowait(Cancelled("the stream was ended (EndStream)"))
                raise

        task = asyncio.ensure_future(run())
        try:
            if request.stream_id and not self._streams.start(request.session_id, request.stream_id, task):
                raise Cancelled("the stream was ended before it started (EndStream)")
        except KVStoreError as refused:
            await abort(context, refused)
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = first_message = True
        try:
            while True:
                if not first and not task.done():
                    gather = min(STREAM_GATHER_MAX_S, max(STREAM_GATHER_MIN_S, 0.1 * (loop.time() - started)))
                    await asyncio.wait((task,), timeout=gather)   # the end is not held back
                first = False
                items = [await events.get()]
                while not events.empty():
                    items.append(events.get_nowait())
                msg = pb.BlockEvent()
                if first_message:
                    msg.lease_id = lease_id
                    first_message = False
                for item in items:
                    if isinstance(item, Exception):
                        if msg.blocks:
                            yield msg   # the blocks already in place still reach the client
                        if isinstance(item, KVStoreError):
                            await abort(context, item)
                        raise item
                    if isinstance(item, StreamEnd):
                        msg.end.CopyFrom(pb.BlockStreamEnd(
                            blocks=item.blocks, requested=item.requested, stop=item.stop, detail=item.detail,
                            lease_id=item.lease_id, lease_ttl_ms=int(item.lease_ttl_s * 1000)))
                    else:
                        msg.blocks.add(index=item.index, tier=_TIER_PB[item.tier], peer=item.peer,
                                       offset=item.offset)
                yield msg
                if msg.HasField("end"):
                    return
        finally:
            if not task.done():
                if not task.cancelling():   # EndStream may have cancelled it: once is enough
                    task.cancel()
                # not ``await task``: this handler cancelled once more would cancel the task again,
                # cutting short its wait for a copy in flight (EndStream waits on the task itself)
                await asyncio.wait([task])

    @mapped
    async def EndStream(self, request: pb.EndStreamRequest, context: grpc.aio.ServicerContext) -> pb.EndStreamResponse:
        await self._streams.end(request.session_id, request.stream_id, self._store.has_session(request.session_id))
        return pb.EndStreamResponse()

    @mapped
    async def Peers(self, request: pb.PeersRequest, context: grpc.aio.ServicerContext) -> pb.PeersResponse:
        if self._peers is None:
            return pb.PeersResponse(membership="off")
        views = await self._peers.probe()
        return pb.PeersResponse(node_id=self._peers.node_id, listen=self._peers.listen,
                                membership=self._peers.membership_name,
                                peers=[pb.PeerInfo(node_id=v.node_id, address=v.address, state=v.state,
                                                   last_error=v.last_error, blocks_fetched=v.blocks_fetched,
                                                   blocks_pushed=v.blocks_pushed) for v in views])

    async def Migrate(self, request: pb.MigrateRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MigrateProgress]:
        try:
            if self._peers is None:
                raise FailedPrecondition("peers are off on this node (configure peers.listen / peers.static / "
                                         "peers.etcd)", Reason.PEERS_OFF)
            prefix = _keys(request.prefix) if request.HasField("prefix") else None
            progress = self._peers.migrate(request.to, request.model, request.namespace_id, prefix, request.drain)
            async for message in _with_heartbeat(progress, _migrate_pb):
                yield message
        except KVStoreError as exc:
            await abort(context, exc)

    @mapped
    async def Prefetch(self, request: pb.PrefetchRequest, context: CallContext) -> pb.PrefetchResponse:
        hit, promoting = self._store.prefetch(request.namespace_id, _keys(request.keys))
        return pb.PrefetchResponse(hit_blocks=hit, promoting_blocks=promoting)

    @mapped
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        if request.tier not in _TIER_FROM_PB:
            raise InvalidArgument(f"unknown tier {request.tier}")
        return pb.EvictResponse(blocks=await self._store.evict_committed(request.model, _TIER_FROM_PB[request.tier]))

    @mapped
    async def Flush(self, request: pb.FlushRequest, context: grpc.aio.ServicerContext) -> pb.FlushResponse:
        return pb.FlushResponse(blocks=await self._store.flush(request.model))

    async def FlushStream(self, request: pb.FlushRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FlushProgress]:
        try:
            async for message in _with_heartbeat(self._store.flushing(request.model), _flush_pb):
                yield message
        except KVStoreError as exc:
            await abort(context, exc)

    @mapped
    async def Stats(self, request: pb.StatsRequest, context: CallContext) -> pb.StatsResponse:
        s = self._store.stats()
        return pb.StatsResponse(
            version=__version__, uptime_s=s.uptime_s,
            tiers=[pb.TierStats(name=t.name, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                                blocks=t.blocks, evictions=t.evictions, write_errors=t.write_errors,
                                read_errors=t.read_errors) for t in s.tiers],
            lookups=s.lookups, lookup_blocks=s.lookup_blocks, hit_blocks=s.hit_blocks,
            hit_tokens=s.hit_tokens, saved_blocks=s.saved_blocks, active_leases=s.active_leases,
            clients=s.clients, namespaces=s.namespaces, index_blocks=s.index_blocks,
            promotions=s.promotions, demotions=s.demotions, dropped_blocks=s.dropped_blocks,
            peer_fetched_blocks=s.peer_fetched_blocks, peer_served_blocks=s.peer_served_blocks,
            peer_received_blocks=s.peer_received_blocks,
            peer_pushed_blocks=self._peers.pushed if self._peers is not None else 0,
            peer_failures=self._peers.failures if self._peers is not None else 0,
            dropped_blocks_by_reason=dict(s.dropped_by_reason),
            room_waits=s.room_waits.count if s.room_waits is not None else 0,
            room_wait_seconds=s.room_waits.sum_s if s.room_waits is not None else 0.0)
