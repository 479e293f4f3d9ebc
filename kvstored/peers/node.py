"""This daemon in its cluster: the peer listener, membership, and block pulls and pushes.

Mechanism between the store and the peer channel: the listener serves blocks out of the store
(bringing SSD blocks to DRAM first) and stores pushed ones; pulls ask every peer how much of a
chain it holds and fetch from the one holding the most, in order, straight into DRAM slots;
pushes run per destination through one queue each, so a chain's blocks arrive parent first and
in the order they were saved. Connections are pooled per peer; a transfer never outlives
``peers.deadline_s`` and a question to a peer never outlives ``peers.lookup_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import zlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstored.addresses import parse_address
from kvstored.cluster.membership import EtcdMembership, Member, Membership, MembershipError, StaticMembership
from kvstored.config import Config, ConfigError, PeersConfig
from kvstored.peers.auth import PeerAuth, TLSFiles, certificate_warning
from kvstored.peers.chain_streams import Fetched, Into, Landed
from kvstored.peers.connection import PeerConnection, PushResult, Stop
from kvstored.peers.errors import PeerAuthError, PeerError, PeerRefused
from kvstored.peers.exchange import PeerExchange
from kvstored.peers.server import BlockServer
from kvstored.peers.wire import MAX_TOKEN_BYTES, Limits
from kvstored.rpc_guard import BadRequests
from kvstored.store import BlockStore, CachedPrefix, KeyRequest
from kvstored_client.contract.errors import FailedPrecondition, InvalidArgument, KVStoreError, NotFound

log = logging.getLogger("kvstored.peers")

PUSH_CHUNK_BLOCKS = 32     # blocks per push request: bounds what a push pins in DRAM at once
FIRST_WINDOW = 64          # keys peers are asked about before a fetch starts
MAX_FETCH_KEYS = 4096      # keys per fetch request after the first window
IDLE_CONNECTIONS = 4       # kept open per peer
# answers that refuse the exchange (credentials either way, a request it will not take): the peer
# shows as "refused", not "down"
_REFUSALS = (PeerRefused, PeerAuthError)
MAX_LOOKUP_KEYS = Limits().max_keys   # keys per LOOKUP request: a longer chain is asked in parts
# Keys queued by push_later for one peer before further pushes to it are dropped (counted as
# failures): a peer slower than the saves, or one gone silent (each queued chain then waits out
# peers.deadline_s), must not make the queue, and this daemon's memory, grow for as long as it lasts.
MAX_QUEUED_PUSH_KEYS = 1 << 16


def auth_from_config(cfg: PeersConfig) -> PeerAuth:
    """The peer credentials the config names; ConfigError when a file cannot be read or the
    token is longer than the peer protocol carries (MAX_TOKEN_BYTES, in UTF-8)."""
    token, key = cfg.token, "peers.token"
    if cfg.token_file:
        token, key = read_token_file(cfg.token_file), f"peers.token_file {cfg.token_file}"
    if len(token.encode()) > MAX_TOKEN_BYTES:
        # else every connection to a peer failed with struct.error packing the HELLO
        raise ConfigError(f"{key}: the token has {len(token.encode())} bytes; the peer protocol carries "
                          f"at most {MAX_TOKEN_BYTES}")
    tls = TLSFiles(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None
    return PeerAuth(tls=tls, token=token, insecure=cfg.insecure)


def read_token_file(path: str) -> str:
    """The token in ``path``: its first non-empty line, stripped of surrounding whitespace.

    ConfigError (naming peers.token_file) when the file cannot be read or holds only whitespace.
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"peers.token_file: cannot read a token from {path}: {reason}") from None
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    raise ConfigError(f"peers.token_file {path} is empty")


def static_members(cfg: PeersConfig) -> list[Member]:
    return [Member(node, addr) for node, _, addr in (e.partition("=") for e in cfg.static)]


@dataclass(frozen=True, slots=True)
class PeerView:
    """One node as ``kvctl peers`` shows it."""

    node_id: str
    address: str
    state: str          # self | up | refused | down | unknown
    last_error: str
    blocks_fetched: int
    blocks_pushed: int


@dataclass(frozen=True, slots=True)
class MigrateProgress:
    total: int
    pushed: int
    failed: int
    dropped: int
    detail: str
    done: bool


@dataclass(slots=True, eq=False)
class _Peer:
    member: Member
    idle: list[PeerConnection] = field(default_factory=list)
    state: str = "unknown"
    last_error: str = ""
    fetched: int = 0
    pushed: int = 0
    queue: asyncio.Queue[tuple[int, list[bytes]]] | None = None
    worker: asyncio.Task[None] | None = None
    pushing: bool = False   # the worker is pushing a chain it took off the queue
    queued_keys: int = 0    # keys of the chains waiting in ``queue``
    refusing: bool = False  # pushes are being dropped for a full queue (logged once until it empties)


class PeerNode:
    """The cluster side of one daemon. ``start`` before use, ``close`` at shutdown."""

    def __init__(self, config: Config, store: BlockStore, *, membership: Membership | None = None,
                 bad_requests: BadRequests | None = None) -> None:
        self._cfg = config.peers
        self._bad_requests = bad_requests
        self._page_bytes = config.dram.page_bytes
        self._store = store
        self.exchange = PeerExchange(store)
        self._auth = auth_from_config(self._cfg)
        self.node_id = self._cfg.node_id or socket.gethostname()
        self._server: BlockServer | None = None
        self._membership = membership
        self._peers: dict[str, _Peer] = {}
        self._watch: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[object]] = set()
        self.listen = ""
        self.failures = 0
        self.pushed = 0

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen (when ``peers.listen`` is set), join the membership and follow it.

        Raises PeerConfigError for an unsafe listener or unusable TLS files, OSError when the
        address cannot be bound, MembershipError when etcd cannot be reached."""
        if self._auth.tls is not None and self._auth.tls.cert_file:
            if warning := certificate_warning(self._auth.tls.cert_file, time.time()):
                log.warning("%s", warning)
        if self._cfg.listen:
            host, port = parse_address(self._cfg.listen)
            exchange = self.exchange
            self._server = BlockServer(host, port, self._auth, exchange.serve, release_block=exchange.checkin,
                                       release_unsent=exchange.checkin_unsent, store_block=exchange.adopt,
                                       land_block=exchange.land, count_blocks=exchange.held,
                                       open_namespace=exchange.learn_namespace, why_refused=exchange.refusal,
                                       limits=Limits(transfer_timeout_s=self._cfg.deadline_s,
                                                     # no larger block can be stored here: a frame
                                                     # claiming more is refused before any byte of it
                                                     max_block_bytes=self._page_bytes),
                                       bad_requests=self._bad_requests)
            await self._server.start()
            bound_host, bound_port = self._server.address
            self.listen = f"{bound_host}:{bound_port}"
        advertise = self._cfg.advertise or self.listen
        if self._membership is None:
            if self._cfg.etcd:
                if not advertise:
                    raise ConfigError("peers.etcd: this node needs peers.listen (or peers.advertise) to join")
                self._membership = EtcdMembership(self._cfg.etcd, self.node_id, advertise, self._cfg.etcd_ttl_s)
            else:
                self._membership = StaticMembership(static_members(self._cfg), self.node_id)
        await self._membership.start()
        self._set_members(await self._membership.members())
        self._watch = asyncio.ensure_future(self._follow())

    @property
    def known_peers(self) -> list[str]:
        """Node ids of the live peers, as the membership last said."""
        return sorted(self._peers)

    @property
    def membership_name(self) -> str:
        return f"etcd {self._cfg.etcd}" if self._cfg.etcd else "static"

    async def _follow(self) -> None:
        assert self._membership is not None
        while True:
            try:
                async for members in self._membership.watch():
                    self._set_members(members)
                return
            except MembershipError as exc:
                log.warning("membership watch failed: %s", exc)
                await asyncio.sleep(1.0)

    def _set_members(self, members: Sequence[Member]) -> None:
        live = {m.node_id: m for m in members if m.node_id != self.node_id}
        for node_id in list(self._peers):
            peer = self._peers[node_id]
            if node_id not in live or live[node_id].address != peer.member.address:
                log.info("peer %s left (%s)", node_id, peer.member.address)
                self._forget(peer, "it left the cluster")
                del self._peers[node_id]
        for node_id, member in live.items():
            if node_id not in self._peers:
                log.info("peer %s joined at %s", node_id, member.address)
                self._peers[node_id] = _Peer(member)

    def _forget(self, peer: _Peer, why: str) -> None:
        for conn in peer.idle:
            conn.close()
        peer.idle.clear()
        if peer.worker is not None:
            peer.worker.cancel()
        # pushes queued by push_later that will not go out now: counted and logged, as it promises
        dropped = (peer.queue.qsize() if peer.queue is not None else 0) + peer.pushing
        if dropped:
            self.failures += dropped
            log.warning("%d queued push(es) to %s dropped: %s", dropped, peer.member.node_id, why)

    async def close(self) -> None:
        """Leave the cluster (etcd: at once), stop listening, end connections and queued pushes."""
        for task in [self._watch, *self._tasks]:
            if task is not None:
                task.cancel()
        for peer in self._peers.values():
            self._forget(peer, "this node is shutting down")
        workers = [p.worker for p in self._peers.values() if p.worker is not None]
        # no peers left: a connection an exchange still in flight gives back is closed, not pooled
        self._peers.clear()
        for task in [self._watch, *self._tasks, *workers]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._membership is not None:
            await self._membership.close()
        if self._server is not None:
            await self._server.close()

    # -- connections --------------------------------------------------------------------------
    def _peer(self, node_id: str) -> _Peer:
        peer = self._peers.get(node_id)
        if peer is None:
            if node_id == self.node_id:
                raise InvalidArgument(f"{node_id!r} is this node; name another node")
            known = ", ".join(sorted(self._peers)) or "none"
            raise NotFound(f"unknown peer {node_id!r} (known peers: {known})")
        return peer

    async def _acquire(self, peer: _Peer, timeout_s: float) -> PeerConnection:
        """A usable connection to ``peer``; raises PeerError (with the reason) when none can be had."""
        while peer.idle:
            conn = peer.idle.pop()
            if conn.usable:
                return conn
            conn.close()
        try:
            async with asyncio.timeout(timeout_s):
                return await PeerConnection.open(peer.member.address, self._auth)
        except TimeoutError:
            raise PeerError(f"no connection to {peer.member.node_id} within {timeout_s:g}s") from None
        except (OSError, ValueError, OverflowError) as exc:   # the latter two: an address no socket takes
            raise PeerError(f"cannot connect to {peer.member.node_id} at {peer.member.address}: {exc}") from None

    def _give_back(self, peer: _Peer, conn: PeerConnection) -> None:
        if conn.usable and len(peer.idle) < IDLE_CONNECTIONS and self._peers.get(peer.member.node_id) is peer:
            peer.idle.append(conn)
        else:
            conn.close()

    def _mark(self, peer: _Peer, error: str = "", refused: bool = False) -> None:
        """The outcome of the latest exchange with ``peer``: its state, and the error while it is
        down or the exchange was ``refused`` (credentials either way, a request it would not take:
        the node answered, so it is a setting or a full store to look at, not a node to restart);
        the error is cleared once an exchange works again."""
        peer.state = "refused" if error and refused else "down" if error else "up"
        peer.last_error = error
        if error:
            self.failures += 1

    # -- questions ----------------------------------------------------------------------------
    async def _held_by(self, peer: _Peer, namespace_id: int, keys: list[bytes],
                       timeout_s: float | None = None) -> int | str:
        """How many leading keys ``peer`` holds, or why it could not say, within ``timeout_s``
        (default ``peers.lookup_timeout_s``), connecting included."""
        timeout_s = self._cfg.lookup_timeout_s if timeout_s is None else timeout_s
        # a question cut short by the asker's deadline: running out of that time is not the peer's fault
        cut = timeout_s < self._cfg.lookup_timeout_s
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn = None
        try:
            conn = await self._acquire(peer, timeout_s)
            # what connecting left of it (a peer slow to accept, a TLS handshake)
            held = await self._count_held(conn, namespace_id, keys, started + timeout_s - loop.time())
            self._mark(peer)
            return held
        except PeerError as exc:
            if not (cut and loop.time() - started >= timeout_s):
                self._mark(peer, str(exc), isinstance(exc, _REFUSALS))
            return str(exc)
        finally:
            if conn is not None:
                self._give_back(peer, conn)

    async def _count_held(self, conn: PeerConnection, namespace_id: int, keys: list[bytes],
                          timeout_s: float) -> int:
        """How many leading ``keys`` the peer holds, asked :data:`MAX_LOOKUP_KEYS` at a time, all
        within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        held = 0
        while True:
            part = keys[held: held + MAX_LOOKUP_KEYS]
            got = await conn.lookup(namespace_id, part, max(0.0, end - loop.time()))
            held += got
            if got < len(part) or held >= len(keys):
                return held

    async def holders(self, namespace_id: int, keys: list[bytes]) -> dict[str, int]:
        """How many leading ``keys`` each peer holds (peers that hold none or do not answer in
        time are left out)."""
        return (await self._ask(namespace_id, keys))[0]

    async def _ask(self, namespace_id: int, keys: list[bytes],
                   timeout_s: float | None = None) -> tuple[dict[str, int], dict[str, str]]:
        if not keys or not self._peers:
            return {}, {}
        peers = list(self._peers.values())
        answers = await asyncio.gather(*(self._held_by(p, namespace_id, keys, timeout_s) for p in peers))
        held = {p.member.node_id: a for p, a in zip(peers, answers) if isinstance(a, int) and a}
        errors = {p.member.node_id: a for p, a in zip(peers, answers) if isinstance(a, str)}
        return held, errors

    async def lookup(self, namespace_id: int, keys: KeyRequest) -> tuple[CachedPrefix, dict[str, int]]:
        """The local lookup, and what each peer holds of the rest of the chain."""
        _, chain = self._store.resolve_keys(namespace_id, keys)
        local = await self._store.lookup(namespace_id, KeyRequest(hashes=chain))
        return local, await self.holders(namespace_id, chain[local.blocks:])

    async def probe(self) -> list[PeerView]:
        """Every node, this one first, after asking each peer a trivial question (bounded)."""
        peers = list(self._peers.values())
        await asyncio.gather(*(self._held_by(p, 0, []) for p in peers))   # refreshes each state
        views = [PeerView(self.node_id, self._cfg.advertise or self.listen, "self", "", 0, 0)]
        views += [PeerView(p.member.node_id, p.member.address, p.state, p.last_error, p.fetched, p.pushed)
                  for p in sorted(peers, key=lambda p: p.member.node_id)]
        return views

    # -- pulls --------------------------------------------------------------------------------
    async def fetch(self, namespace_id: int, keys: list[bytes], into: Into, landed: Landed, *,
                    until: float | None = None) -> Fetched:
        """A :data:`kvstored.peers.chain_streams.Fetcher`: fetch ``keys`` in order from the peers. Never raises
        for a peer's failure: the result says how far it got and why.

        The peers are asked about the next :data:`FIRST_WINDOW` keys only, so the first block
        does not wait for every peer to match a whole long prompt; the chosen peer then sends
        the rest of the chain until it lacks a block, and the next peer is found the same way.
        The whole fetch ends within ``peers.deadline_s``, and by ``until`` (the event loop's
        time: the deadline of the caller waiting for the outcome) when that is sooner."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self._cfg.deadline_s
        callers = until is not None and until < end
        if until is not None:
            end = min(end, until)
        deadline = "the caller's deadline" if callers else f"peers.deadline_s ({self._cfg.deadline_s:g}s)"
        done = 0
        while done < len(keys):
            left = end - loop.time()
            if left <= 0:   # not a fault of any peer: none is marked down for it
                return Fetched(done, "timeout", f"{deadline} passed after {done} block(s)")
            holders, errors = await self._ask(namespace_id, keys[done: done + FIRST_WINDOW],
                                              min(self._cfg.lookup_timeout_s, left))
            if not holders and errors and loop.time() >= end:   # the question ran out of the fetch's time
                return Fetched(done, "timeout", f"{deadline} passed after {done} block(s) while the peers were asked")
            if not holders:
                if not self._peers:
                    return Fetched(done, "no_peers", "this node has no peers")
                if errors:
                    return Fetched(done, "unreachable", "; ".join(f"{n}: {e}" for n, e in sorted(errors.items())))
                return Fetched(done, "missing", f"no peer holds block {done}")
            node_id = max(sorted(holders), key=lambda n: holders[n])
            peer = self._peers.get(node_id)
            if peer is None:
                return Fetched(done, "unreachable", f"peer {node_id} left the cluster")
            # what the peer said it holds first (the first block comes at once), then the rest
            parts = [keys[done: done + holders[node_id]]]
            if holders[node_id] == FIRST_WINDOW:
                parts += [keys[i: i + MAX_FETCH_KEYS] for i in range(done + FIRST_WINDOW, len(keys), MAX_FETCH_KEYS)]
            before = done
            for part in parts:
                got, stop, detail = await self._fetch_from(peer, namespace_id, part, done, into, landed,
                                                           max(0.0, end - loop.time()), callers)
                done += got
                if stop == "missing":
                    break      # this peer's run ends here: ask who holds the next block
                if stop != "complete":
                    # no_room is this node's own shortage, not the peer's
                    return Fetched(done, stop, detail if stop == "no_room" else f"{node_id}: {detail}")
            if done == before:   # it lost the block between the question and the fetch
                return Fetched(done, "missing", f"no peer holds block {done}")
        return Fetched(done, "complete")

    async def _fetch_from(self, peer: _Peer, namespace_id: int, keys: list[bytes], first: int, into: Into,
                          landed: Landed, deadline_s: float, callers: bool = False) -> tuple[int, str, str]:
        """One fetch request; keys[0] is block ``first`` of the caller's chain. ``callers``: the
        deadline is the caller's, shorter than peers.deadline_s (the peer is not marked down when
        it runs out)."""
        node_id = peer.member.node_id
        conn = None
        arrived = 0
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s

        async def on_block(i: int, _view: memoryview) -> None:
            nonlocal arrived
            await landed(first + i, node_id)
            arrived = i + 1

        try:
            conn = await self._acquire(peer, deadline_s)
            # what connecting left of it (a new connection: the pool had none idle)
            result = await conn.fetch(namespace_id, keys, on_block, max(0.0, end - loop.time()),
                                      into=lambda i, length: into(first + i, length))
        except PeerError as exc:
            self._mark(peer, str(exc), isinstance(exc, _REFUSALS))
            return 0, "unreachable", str(exc)
        except ValueError as exc:   # the peer sent a block this node cannot take (another size)
            peer.fetched += arrived
            self._mark(peer, str(exc))
            return arrived, "peer_error", str(exc)
        except KVStoreError as exc:   # the store had no slot for the next block: the connection is dropped
            peer.fetched += arrived
            return arrived, "no_room", str(exc)
        finally:
            if conn is not None:
                self._give_back(peer, conn)
        peer.fetched += result.delivered
        if result.stop is Stop.MISSING:
            return result.delivered, "missing", result.detail
        if not result.complete:
            if not (callers and result.stop is Stop.TIMEOUT):
                self._mark(peer, f"fetch stopped after {result.delivered} block(s): {result.detail}")
            return result.delivered, result.stop.value, result.detail
        self._mark(peer)
        return result.delivered, "complete", ""

    # -- pushes -------------------------------------------------------------------------------
    def check_peer(self, node_id: str) -> None:
        """NotFound unless ``node_id`` is a live peer (validate before doing the work)."""
        self._peer(node_id)

    def push_later(self, node_id: str, namespace_id: int, chain: list[bytes]) -> None:
        """Queue the chain for ``node_id``; its blocks go out in order behind earlier pushes to
        the same node, skipping those it holds. Failures are logged and counted, not raised
        (a node that left the cluster since the caller checked it, too: the save it follows
        succeeded)."""
        if not chain:
            return
        peer = self._peers.get(node_id)
        if peer is None:
            self.failures += 1
            log.warning("push of %d block(s) to %s dropped: it is no longer a peer", len(chain), node_id)
            return
        if peer.queue is None:
            peer.queue = asyncio.Queue()
            peer.worker = asyncio.ensure_future(self._push_worker(peer, peer.queue))
        if peer.queued_keys and peer.queued_keys + len(chain) > MAX_QUEUED_PUSH_KEYS:
            self.failures += 1
            if not peer.refusing:
                peer.refusing = True
                log.warning("push of %d block(s) to %s dropped: %d block(s) are already queued for it (it is "
                            "slower than the saves, or not answering); further pushes to it are dropped "
                            "until its queue empties", len(chain), node_id, peer.queued_keys)
            return
        peer.queued_keys += len(chain)
        peer.queue.put_nowait((namespace_id, chain))

    async def _push_worker(self, peer: _Peer, queue: asyncio.Queue[tuple[int, list[bytes]]]) -> None:
        while True:
            namespace_id, chain = await queue.get()
            peer.queued_keys -= len(chain)
            if not peer.queued_keys:
                peer.refusing = False
            peer.pushing = True
            try:
                stored, result = await self.push_chain(peer.member.node_id, namespace_id, b"", chain, skip_held=True)
                if not result.complete:
                    # acknowledged blocks only: the receiver keeps each block as it lands, so after
                    # a timeout it may hold more than this
                    log.warning("push to %s stopped after %d of %d block(s) acknowledged: %s", peer.member.node_id,
                                stored, len(chain), result.detail)
            except Exception:   # a bug in one push must not stop later ones
                log.exception("push to %s failed", peer.member.node_id)
            finally:
                peer.pushing = False

    async def push_chain(self, node_id: str, namespace_id: int, parent: bytes, keys: list[bytes], *,
                         skip_held: bool = False) -> tuple[int, PushResult]:
        """Push a run of blocks (under ``parent``, b"" = the root) to ``node_id`` in chunks;
        returns how many the receiver holds now, and how the last exchange ended (UNREACHABLE when
        ``node_id`` is no longer a peer: it may leave the cluster in the middle of a migration)."""
        peer = self._peers.get(node_id)
        if peer is None:
            return 0, PushResult(0, 0, Stop.UNREACHABLE, f"{node_id} is no longer a peer")
        conn = None
        done = 0
        try:
            conn = await self._acquire(peer, self._cfg.deadline_s)
            await conn.open_namespace(namespace_id, self.exchange.describe_namespace(namespace_id),
                                      self._cfg.lookup_timeout_s)
            if skip_held:
                done = await self._count_held(conn, namespace_id, keys, self._cfg.lookup_timeout_s)
                parent = keys[done - 1] if done else parent
            while done < len(keys):
                chunk = keys[done: done + PUSH_CHUNK_BLOCKS]
                result = await self._push_chunk(conn, namespace_id, parent, chunk)
                done += result.stored
                peer.pushed += result.stored
                self.pushed += result.stored
                if not result.complete:
                    # MISSING: this node no longer holds the next block (evicted since the push was
                    # queued): the peer answered every exchange, it is not down for that
                    self._mark(peer, "" if result.stop is Stop.MISSING else f"push stopped: {result.detail}",
                               refused=result.stop is Stop.REFUSED)
                    return done, result
                parent = chunk[-1]
            self._mark(peer)
            return done, PushResult(len(keys), len(keys), Stop.COMPLETE)
        except PeerError as exc:
            self._mark(peer, str(exc), isinstance(exc, _REFUSALS))
            # an answer that refuses the namespace is the receiver declining, as for a block
            return done, PushResult(0, 0, Stop.REFUSED if isinstance(exc, PeerRefused) else Stop.UNREACHABLE,
                                    str(exc))
        except NotFound as exc:   # this node forgot the namespace: not the peer's fault
            return done, PushResult(0, 0, Stop.MISSING, str(exc))
        finally:
            if conn is not None:
                self._give_back(peer, conn)

    async def _push_chunk(self, conn: PeerConnection, namespace_id: int, parent: bytes,
                          keys: list[bytes]) -> PushResult:
        """Check the blocks out of the store (pinned, in DRAM), push them, check them back in."""
        views: list[tuple[bytes, memoryview]] = []
        checks: list[int | None] = []
        try:
            for key in keys:
                served = await self.exchange.checkout(namespace_id, key, served=False)
                if served is None:
                    break
                views.append((key, served[0]))
                checks.append(served[1])
            if not views:
                return PushResult(0, 0, Stop.MISSING, f"block {keys[0].hex()[:16]}… is no longer held here")
            result = await conn.push(namespace_id, views, self._cfg.deadline_s, parent=parent, checksums=checks)
            if result.complete and len(views) < len(keys):
                return PushResult(len(views), len(views), Stop.MISSING,
                                  f"block {keys[len(views)].hex()[:16]}… is no longer held here")
            return result
        finally:
            for key, _ in views:
                self.exchange.checkin(namespace_id, key)

    # -- migrate and drain --------------------------------------------------------------------
    async def migrate(self, to: str, model: str = "", namespace_id: int = 0, prefix: KeyRequest | None = None,
                      drain: bool = False) -> AsyncGenerator[MigrateProgress, None]:
        """Push ``model``'s namespaces (all when empty), or one prefix chain, to ``to`` (with
        ``drain`` and no ``to``: each tree to one of the peers), yielding progress after each
        chunk; with ``drain``, the local copies of what the receivers stored are dropped at the
        end. InvalidArgument / NotFound / FailedPrecondition before anything moves."""
        if to:
            self._peer(to)
        elif not drain:
            raise InvalidArgument("migrate needs a destination node (to)")
        if prefix is None and namespace_id:
            # namespace_id names the prefix's namespace; alone it was ignored, and every
            # namespace of every model moved (with drain, left this node)
            raise InvalidArgument("namespace_id names the namespace of a prefix: give the prefix too "
                                  "(or model, for whole namespaces)")
        targets = [to] if to else sorted(self._peers)
        if not targets:
            raise FailedPrecondition("no peers to drain onto")
        if prefix is not None:   # one chain; a prefix of no whole block moves nothing
            state, chain = self._store.resolve_keys(namespace_id, prefix)
            if model and state.spec.model != model:
                raise InvalidArgument(f"the prefix is in namespace {namespace_id} of model {state.spec.model!r}, "
                                      f"not of model {model!r}")
            held = chain[: self.exchange.held(namespace_id, chain)]
            runs = [(namespace_id, b"", held)] if held else []
        else:
            runs = self.exchange.namespace_chains(model)
        total = sum(len(r[2]) for r in runs)
        pushed = failed = 0
        detail = ""
        moved: list[tuple[int, str, list[bytes]]] = []
        root_of: dict[bytes, bytes] = {}
        target_of: dict[bytes, str] = {}   # a whole tree goes to one node: a block is stored only under its parent
        alive = list(targets)
        yield MigrateProgress(total, 0, 0, 0, "", False)
        for namespace_id_, parent, keys in runs:
            root = root_of.get(parent, parent) or keys[0]
            for key in keys:
                root_of[key] = root
            target = target_of.get(root)
            while True:
                chosen = target or alive[zlib.crc32(root) % len(alive)]
                stored, result = await self.push_chain(chosen, namespace_id_, parent, keys)
                if stored or result.stop not in (Stop.UNREACHABLE, Stop.REFUSED) or target is not None \
                        or len(alive) < 2:
                    break
                # a drain onto a node that is down (a static peer that left), or that refuses the
                # namespace (another block size, a hash it does not allow): its trees go to the others
                alive.remove(chosen)
                detail = f"{chosen}: {result.detail}"
            target_of[root] = chosen
            if not result.complete:
                detail = f"{chosen}: {result.detail}"
            pushed += stored
            failed += len(keys) - stored
            moved.append((namespace_id_, chosen, keys[:stored]))
            yield MigrateProgress(total, pushed, failed, 0, detail, False)
        dropped = 0
        if drain:
            # The receivers took every block, evicting what they had to: by now some of what this
            # drain pushed may be gone there. Only what they still hold leaves here.
            for namespace_id_, node_id, keys in reversed(moved):
                peer = self._peers.get(node_id)
                still = await self._held_by(peer, namespace_id_, keys) if peer is not None and keys else 0
                if isinstance(still, int) and still:
                    dropped += self.exchange.forget(namespace_id_, keys[:still])
        yield MigrateProgress(total, pushed, failed, dropped, detail, True)
