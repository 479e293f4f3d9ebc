"""kvstored: a per-node KV-cache storage daemon for LLM inference, and its client SDK.

Importing ``kvstored`` gives the SDK (``kvstored.Client``, ``kvstored.block_hashes``) and loads
nothing of the daemon: an engine process must not pull in lmdb or uvloop.
"""

from kvstored_client import (
    Client,
    DaemonNotRunning,
    KVStoreError,
    LeaseExpired,
    Namespace,
    TensorLayout,
    block_hashes,
    shm,
)
from kvstored_client.version import __version__

__all__ = ["Client", "DaemonNotRunning", "KVStoreError", "LeaseExpired", "Namespace",
           "TensorLayout", "__version__", "block_hashes", "shm"]
