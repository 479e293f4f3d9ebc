"""Cluster membership: who the live peers are and where their block channels listen.

Two implementations of one interface:

* :class:`StaticMembership`: a fixed list from the configuration; no liveness, no etcd.
* :class:`EtcdMembership`: each daemon registers ``<prefix><node_id>`` under an etcd lease and keeps
  the lease alive; a daemon that dies stops refreshing, etcd expires the lease and deletes the key,
  and every other daemon sees it leave (within about ``ttl_s``). A daemon that shuts down cleanly
  revokes its lease and leaves at once. If the lease is lost while the daemon lives (it was cut off
  from etcd for longer than ``ttl_s``), the keepalive registers it again under a new lease.

Members are listed sorted by node id. The etcd client is ``aetcd`` (asyncio over etcd's gRPC v3 API).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvstored.cluster")

DEFAULT_PREFIX = "/kvstored/members/"


class MembershipError(Exception):
    """The membership service cannot be reached or refused a request; the message says which."""


@dataclass(frozen=True, slots=True, order=True)
class Member:
    """One daemon: its stable id and the ``host:port`` of its peer block channel."""

    node_id: str
    address: str

    def encode(self) -> bytes:
        return json.dumps({"node_id": self.node_id, "address": self.address}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Member:
        """Raises ValueError for a record that is not a member."""
        try:
            obj = json.loads(raw)
            node_id, address = obj["node_id"], obj["address"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a member record: {raw[:80]!r}") from exc
        if not isinstance(node_id, str) or not isinstance(address, str) or not node_id:
            raise ValueError(f"not a member record: {raw[:80]!r}")
        return cls(node_id, address)


class Membership(abc.ABC):
    """Who is in the cluster. ``start`` before use, ``close`` when done (or ``async with``)."""

    node_id: str

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Join (register this node, where the implementation registers)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Leave and release resources; idempotent."""

    @abc.abstractmethod
    async def members(self) -> tuple[Member, ...]:
        """Every live member, this node included where it registered, sorted by node id."""

    async def peers(self) -> tuple[Member, ...]:
        """The live members other than this node."""
        return tuple(m for m in await self.members() if m.node_id != self.node_id)

    @abc.abstractmethod
    def watch(self) -> AsyncIterator[tuple[Member, ...]]:
        """Yield the current members, then the new list after every change, until closed."""

    async def __aenter__(self) -> Membership:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class StaticMembership(Membership):
    """A fixed member list (``peers`` in the config); every member is assumed alive."""

    def __init__(self, members: Sequence[Member], node_id: str = "") -> None:
        ids = [m.node_id for m in members]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate node ids in the static peer list: {sorted(ids)}")
        self.node_id = node_id
        self._members = tuple(sorted(members))
        self._closed = asyncio.Event()

    async def members(self) -> tuple[Member, ...]:
        return self._members

    async def close(self) -> None:
        self._closed.set()

    async def watch(self) -> AsyncIterator[tuple[Member, ...]]:
        yield self._members
        await self._closed.wait()


class EtcdMembership(Membership):
    """Membership through etcd leases (see the module docstring).

    ``endpoint``: ``host:port`` (or ``http://host:port``) of an etcd client URL. ``ttl_s``: lease
    time to live in whole seconds (etcd raises very short TTLs to its minimum, about 2 s); the lease
    is refreshed every ``ttl_s / 3``. ``timeout_s`` bounds every etcd request."""

    def __init__(self, endpoint: str, node_id: str, address: str, ttl_s: int = 10, *,
                 prefix: str = DEFAULT_PREFIX, timeout_s: float = 5.0, register: bool = True) -> None:
        if not node_id or "/" in node_id:
            raise ValueError(f"node_id must be non-empty without '/', got {node_id!r}")
        if ttl_s < 1:
            raise ValueError("ttl_s must be at least 1 second")
        host, port = _split_endpoint(endpoint)
        self.node_id = node_id
        self.me = Member(node_id, address)
        self._host, self._port = host, port
        self._ttl = int(ttl_s)
        self._prefix = prefix.encode()
        self._timeout = timeout_s
        self._client: Any = None
        self._lease_id: int | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self.registrations = 0    # how many times this node (re)registered; for tests and metrics
        self._register_self = register   # False: only watch the members (a router is not one)

    @property
    def key(self) -> bytes:
        return self._prefix + self.node_id.encode()

    async def start(self) -> None:
        """Connect, register under a fresh lease and start the keepalive. Raises MembershipError."""
        import aetcd

        self._client = aetcd.Client(self._host, self._port, timeout=max(1, round(self._timeout)),
                                    connect_wait_timeout=max(1, round(self._timeout)))
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.connect()
            if self._register_self:
                await self._register()
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            await self._client.close()
            self._client = None
            raise MembershipError(f"cannot register {self.node_id!r} in etcd at {self._host}:{self._port}: "
                                  f"{exc or type(exc).__name__}") from None
        if self._register_self:
            self._keepalive = asyncio.ensure_future(self._keep_alive())

    async def _register(self) -> None:
        async with asyncio.timeout(self._timeout):
            lease = await self._client.lease(self._ttl)
            await self._client.put(self.key, self.me.encode(), lease=lease.id)
        self._lease_id = lease.id
        self.registrations += 1
        log.info("registered %s at %s in etcd (lease %x, ttl %ds)", self.node_id, self.me.address, lease.id,
                 self._ttl)

    async def _keep_alive(self) -> None:
        import aetcd

        interval = self._ttl / 3
        while not self._closed.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._closed.wait()
            if self._closed.is_set():
                return
            try:
                async with asyncio.timeout(self._timeout):
                    reply = await self._client.refresh_lease(self._lease_id)
                if reply is None or reply.TTL <= 0:
                    log.warning("etcd lease of %s expired (cut off for longer than %ds?): registering again",
                                self.node_id, self._ttl)
                    await self._register()
            except (aetcd.ClientError, TimeoutError, OSError) as exc:
                log.warning("etcd keepalive for %s failed: %s", self.node_id, exc or type(exc).__name__)
            except Exception:   # unforeseen: log it and keep trying, or the node drops out in silence
                log.exception("etcd keepalive for %s failed", self.node_id)

    async def close(self) -> None:
        """Stop the keepalive, revoke the lease (this node leaves at once) and disconnect."""
        self._closed.set()
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        if self._client is not None:
            if self._lease_id is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self._timeout):
                        await self._client.revoke_lease(self._lease_id)
            with contextlib.suppress(Exception):
                await self._client.close()
            self._client = None

    async def _list(self) -> tuple[tuple[Member, ...], int]:
        import aetcd

        if self._client is None:
            raise MembershipError("membership is not started")
        try:
            async with asyncio.timeout(self._timeout):
                result = await self._client.get_prefix(self._prefix)
        except (aetcd.ClientError, TimeoutError, OSError) as exc:
            raise MembershipError(f"cannot list members in etcd: {exc or type(exc).__name__}") from None
        members = []
        for kv in result:
            try:
                members.append(Member.decode(kv.value))
            except ValueError as exc:
                log.warning("ignoring %r in etcd: %s", kv.key, exc)
        return tuple(sorted(members)), result.header.revision

    async def members(self) -> tuple[Member, ...]:
        return (await self._list())[0]

    async def watch(self) -> AsyncIterator[tuple[Member, ...]]:
        """Lists, then follows an etcd watch from that revision; on a watch failure it lists again
        after a pause, so a change is never missed for longer than that pause."""
        import aetcd

        last: tuple[Member, ...] | None = None
        while not self._closed.is_set():
            watch = None
            try:
                members, revision = await self._list()
                if members != last:
                    last = members
                    yield members
                watch = await self._client.watch_prefix(self._prefix, start_revision=revision + 1)
                async for _event in watch:
                    members = await self.members()
                    if members != last:
                        last = members
                        yield members
                    if self._closed.is_set():
                        return
            except (MembershipError, aetcd.ClientError, OSError) as exc:
                log.warning("etcd watch of %s failed: %s; listing again", self._prefix.decode(), exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._closed.wait()
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await watch.cancel()


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    rest = endpoint.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected an etcd endpoint like 127.0.0.1:2379, got {endpoint!r}")
    return host.strip("[]"), int(port)
