"""The connector's line to the daemon: a :class:`Client` made on first use and made again after
the daemon went away, whose failures become "nothing cached" / "not stored" for the engine.

A daemon that is down, restarting or too slow must never take the engine down: vLLM recomputes
what kvstored cannot give. Each failure streak is logged once, and its end once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstored_client.buffers import Buffers
from kvstored_client.client import Client
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.namespace import Namespace
from kvstored_client.errors import ClientClosed

log = logging.getLogger(__name__)

# After a failed connect, how long calls answer "no daemon" without trying again: a missing socket
# fails in microseconds, but a daemon that accepts and never answers costs a whole timeout per try.
RETRY_CONNECT_S = 1.0


class DaemonLink:
    """Lookups, saves and loads by an engine's hashes in ``namespace``; none of them raises a
    :class:`KVStoreError`. With ``peers`` lookups count blocks peer daemons hold and loads fetch
    them first. Not thread-safe: one link per thread that calls it."""

    def __init__(self, socket: str, namespace: Namespace, timeout_s: float, name: str, peers: bool = False) -> None:
        self.namespace = namespace
        self._peers = peers
        self._socket = socket or None
        self._timeout_s = timeout_s
        self._name = name
        self._client: Client | None = None
        self._tensors: list[Any] = []
        self._buffers: Buffers | None = None
        self._next_connect = 0.0
        self._failing = False

    def _connected(self) -> Client | None:
        if self._client is not None:
            return self._client
        if time.monotonic() < self._next_connect:
            return None
        try:
            self._client = Client(self._socket, namespace=self.namespace, client_name=self._name,
                                  timeout_s=self._timeout_s)
        except KVStoreError as exc:
            self._next_connect = time.monotonic() + RETRY_CONNECT_S
            self._failed("connect", exc)
            return None
        return self._client

    def _failed(self, what: str, exc: Exception) -> None:
        if not self._failing:
            log.warning("kvstored: %s failed (%s: %s); serving without kvstored until it answers again",
                        what, type(exc).__name__, exc)
        self._failing = True
        if isinstance(exc, ClientClosed):
            self._client = None
            self._buffers = None

    def _ok(self) -> None:
        if self._failing:
            log.warning("kvstored: the daemon answers again")
        self._failing = False

    def lookup(self, hashes: Sequence[bytes], peers: bool | None = None) -> int:
        """Leading blocks of the chain the daemon holds (0 if it cannot say); with ``peers``
        (default: the link's) counting what its peers hold after its own prefix."""
        return self.lookup_split(hashes, self._peers if peers is None else peers)[1]

    def lookup_split(self, hashes: Sequence[bytes], peers: bool = True) -> tuple[int, int]:
        """Leading blocks of the chain held on this node, and with what ``peers`` hold after
        them ((0, 0) if the daemon cannot say)."""
        client = self._connected()
        if client is None or not hashes:
            return 0, 0
        try:
            hit = client.lookup(hashes=hashes, peers=peers)
        except KVStoreError as exc:
            self._failed("lookup", exc)
            return 0, 0
        self._ok()
        return hit.blocks - hit.per_tier.get("peer", 0), hit.blocks

    def pull(self, hashes: Sequence[bytes]) -> int:
        """Bring what peers hold of the chain to this node; returns when it is here (or the
        transfer stopped), with the leading blocks now local (0 if the daemon cannot say)."""
        client = self._connected()
        if client is None or not hashes:
            return 0
        try:
            outcome = client.pull(hashes=hashes)
        except KVStoreError as exc:
            self._failed("pull from peers", exc)
            return 0
        self._ok()
        return outcome.blocks

    def _pull(self, client: Client, hashes: Sequence[bytes], namespace: Namespace) -> None:
        """With ``peers``: bring what peers hold of the chain to this node first. A pull that
        fails (no peers configured, a peer gone) leaves the load to what is local."""
        if not self._peers:
            return
        try:
            client.pull(hashes=hashes, namespace=namespace)
        except KVStoreError as exc:
            self._failed("pull from peers", exc)

    def load(self, hashes: Sequence[bytes], start: int = 0) -> tuple[int, np.ndarray] | None:
        """How many leading blocks of the chain are cached, and the rows (one row of bytes per
        block) of those from block ``start`` on; None if the daemon cannot say."""
        client = self._connected()
        if client is None or not hashes:
            return None
        try:
            self._pull(client, hashes, self.namespace)
            result = client.load(hashes=hashes, start=start)
        except KVStoreError as exc:
            self._failed("load", exc)
            return None
        self._ok()
        return result.blocks, result.data

    def save(self, hashes: Sequence[bytes], rows: Any, push_to: str = "", start: int = 0) -> int:
        """Store the chain, given the rows of blocks ``start`` on (one per block; the blocks before
        must be stored already, else nothing is); how many leading blocks are now stored (0 on
        failure)."""
        client = self._connected()
        if client is None or not hashes:
            return 0
        try:
            result = client.save(None, rows, hashes=hashes, push_to=push_to, start=start)
        except KVStoreError as exc:
            self._failed("save", exc)
            return 0
        self._ok()
        return result.present + result.stored

    def share(self, tensors: Sequence[Any]) -> None:
        """The engine's KV tensors in shared memory, one per layer with one row of bytes per block:
        registered with the daemon on first use (and by the SDK again after a daemon restart)."""
        self._tensors = list(tensors)
        self._buffers = None

    @property
    def shares(self) -> bool:
        return bool(self._tensors)

    def _registered(self) -> tuple[Client, Buffers] | None:
        client = self._connected()
        if client is None or not self._tensors:
            return None
        if self._buffers is None:
            try:
                self._buffers = client.register_buffers(self._tensors, 0, namespace=self.namespace)
            except KVStoreError as exc:
                self._failed("register_buffers", exc)
                return None
        return client, self._buffers

    def load_blocks(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> Any:
        """Start the daemon's copy of the chain's cached prefix into engine blocks ``block_ids``
        (one per hash); a :class:`LoadHandle`, or None if the daemon cannot be asked."""
        registered = self._registered()
        if registered is None:
            return None
        client, buffers = registered
        try:
            self._pull(client, hashes, buffers.namespace)
            handle = client.load_blocks(buffers, block_ids, hashes=hashes, wait=False)
        except KVStoreError as exc:
            self._failed("load_blocks", exc)
            return None
        self._ok()
        return handle

    def save_blocks(self, block_ids: Sequence[int], hashes: Sequence[bytes], push_to: str = "") -> int:
        """The daemon stores engine blocks ``block_ids`` as the chain (what it has it skips)."""
        registered = self._registered()
        if registered is None:
            return 0
        client, buffers = registered
        try:
            result = client.save_blocks(buffers, block_ids, hashes=hashes, push_to=push_to)
        except KVStoreError as exc:
            self._failed("save_blocks", exc)
            return 0
        self._ok()
        return result.present + result.stored

    def failed(self, what: str, exc: Exception) -> None:
        """A failure of a call the link started (a load handle's wait), logged like its own."""
        self._failed(what, exc)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
            self._buffers = None
