"""kvstored: a per-node KV-cache storage daemon for LLM inference, and its client SDK.

Importing ``kvstored`` gives the SDK (``kvstored.Client``, ``kvstored.block_hashes``, the error
types, ``kvstored.shm``) and loads nothing of the daemon: an engine process must not pull in lmdb
or uvloop.
"""

from kvstored_client import (
    Buffers,
    Client,
    ClientClosed,
    DaemonNotRunning,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    LoadResult,
    LookupResult,
    Namespace,
    NotFound,
    ResourceExhausted,
    SaveResult,
    TensorLayout,
    __version__,
    block_hashes,
    shm,
)

__all__ = [
    "Buffers", "Client", "ClientClosed", "DaemonNotRunning", "DeadlineExceeded", "FailedPrecondition",
    "InvalidArgument", "KVStoreError", "LeaseExpired", "LoadResult", "LookupResult", "Namespace", "NotFound",
    "ResourceExhausted", "SaveResult", "TensorLayout", "__version__", "block_hashes", "shm",
]
