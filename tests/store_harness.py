"""A BlockStore for unit tests, built from config values over a temporary directory."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from clock import Clock

from kvstored import config
from kvstored.copy import CopyEngine
from kvstored.peers.chain_streams import ChainStreamer
from kvstored.peers.exchange import PeerExchange
from kvstored.presence import PresenceTable
from kvstored.store import BlockStore
from kvstored.tiers.dram import Arena
from kvstored.tiers.ssd import SSDTier
from kvstored_client.contract.hashing import block_hashes


@contextlib.contextmanager
def open_store(tmp_path: Path, values: dict[str, dict[str, object]],
               ssd: bool = False, presence: PresenceTable | None = None) -> Iterator[tuple[BlockStore, Clock]]:
    """A store configured by ``values`` (an arena in ``tmp_path``, not pre-faulted; with ``ssd``,
    an SSD tier in ``tmp_path / "ssd"``; ``presence``: its presence table), on a manual clock,
    its sessions named s1, s2, ...; everything is closed on exit. No write-back task runs unless a test starts one
    (``store.writeback_loop()``), so ``dram.room_wait_s`` defaults to :data:`ROOM_WAIT_S` here."""
    cfg = config.build({**values, "dram": {"room_wait_s": ROOM_WAIT_S, **values.get("dram", {})}})
    arena = Arena(str(tmp_path), cfg.dram.capacity, prefault=False)
    copy = CopyEngine(arena)
    tier = SSDTier(str(tmp_path / "ssd"), 8 << 20, sync=False) if ssd else None
    clock = Clock()
    ids = iter(range(1, 1000))
    store = BlockStore(cfg, arena, copy, tier, clock=clock, new_session_id=lambda: f"s{next(ids)}",
                       presence=presence)
    try:
        yield store, clock
    finally:
        if tier is not None:
            tier.close()
        copy.close()
        arena.close()


# How long a save or a read waits for a write-back that, in most unit tests, nobody runs: long
# enough for the tests that start one, short enough not to slow those that do not.
ROOM_WAIT_S = 0.05


def chain(n: int, start: int = 0) -> list[bytes]:
    """The keys of ``n`` blocks of 16 tokens, tokens ``start`` onwards (the default namespace's)."""
    return block_hashes(list(range(start, start + 16 * n)))


_EXCHANGES: weakref.WeakKeyDictionary[BlockStore, PeerExchange] = weakref.WeakKeyDictionary()
_STREAMERS: weakref.WeakKeyDictionary[BlockStore, ChainStreamer] = weakref.WeakKeyDictionary()


def exchange(store: BlockStore) -> PeerExchange:
    """The store's side of the exchange with peers (one per store, as a PeerNode has)."""
    ex = _EXCHANGES.get(store)
    if ex is None:
        ex = _EXCHANGES[store] = PeerExchange(store)
    return ex


def streamer(store: BlockStore) -> ChainStreamer:
    """The store's chain streams (one per store, as the servicer has)."""
    st = _STREAMERS.get(store)
    if st is None:
        st = _STREAMERS[store] = ChainStreamer(store)
    return st


def gate_ssd_read(store: BlockStore, *keys: bytes) -> threading.Event:
    """Hold the SSD reads of ``keys`` (of every block when none are named) until the returned
    event is set; other reads run as usual."""
    assert store.ssd_tier is not None
    real, gate = store.ssd_tier.read_into, threading.Event()
    held = set(keys)

    def gated(namespace_id: int, k: bytes, dst):  # type: ignore[no-untyped-def]
        if held and k not in held:
            return real(namespace_id, k, dst)
        out: Future[int] = Future()

        def later() -> None:
            gate.wait(10)
            try:
                out.set_result(real(namespace_id, k, dst).result(10))
            except Exception as exc:
                out.set_exception(exc)
        threading.Thread(target=later, daemon=True).start()
        return out

    store.ssd_tier.read_into = gated  # type: ignore[method-assign]
    return gate
