"""A node whose only peer accepts connections and never answers (a partitioned peer), in process."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loopback import free_ports

from kvstored import config
from kvstored.copy import CopyEngine
from kvstored.peers.node import PeerNode
from kvstored.store import BlockStore
from kvstored.tiers.dram import Arena
from kvstored_client.contract.namespace import Namespace


@dataclass
class SilentPeerNode:
    store: BlockStore
    peers: PeerNode
    arena: Arena
    namespace_id: int


@contextlib.asynccontextmanager
async def node_with_a_silent_peer(ns: Namespace, *, deadline_s: float,
                                  lookup_timeout_s: float) -> AsyncIterator[SilentPeerNode]:
    """Node "b" (8 blocks of ``ns.block_bytes``, ``ns`` open) whose static peer "x" is silent."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()   # accepts, never answers, until the other side goes away
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    (own,) = free_ports(1)
    block = ns.block_bytes
    cfg = config.build({"dram": {"capacity": 8 * block, "page_bytes": 4 * block, "prefault": False},
                        "peers": {"listen": f"127.0.0.1:{own}", "node_id": "b", "token": "t",
                                  "static": [f"b=127.0.0.1:{own}", f"x=127.0.0.1:{port}"],
                                  "deadline_s": deadline_s, "lookup_timeout_s": lookup_timeout_s}})
    arena = Arena(tempfile.mkdtemp(), cfg.dram.capacity, prefault=False)
    copy = CopyEngine(arena)
    store = BlockStore(cfg, arena, copy)
    ns_id = store.open_namespace(ns).namespace_id
    peers = PeerNode(cfg, store)
    try:
        await peers.start()
        yield SilentPeerNode(store, peers, arena, ns_id)
    finally:
        await peers.close()
        server.close()
        copy.close()
        arena.close()
