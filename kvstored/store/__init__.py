"""The block store: :class:`BlockStore` (the front) and the values it takes and answers with."""

from kvstored.store.front import BlockStore, PeerTraffic
from kvstored.store.values import (
    CachedPrefix,
    FlushProgress,
    KeyRequest,
    Reservation,
    RestoreReport,
    StoreStats,
    StreamEnd,
    TierStats,
)

__all__ = ["BlockStore", "CachedPrefix", "FlushProgress", "KeyRequest", "PeerTraffic", "Reservation",
           "RestoreReport", "StoreStats", "StreamEnd", "TierStats"]
