"""kvstored client SDK: talk to the local kvstored daemon from an inference engine.

Light on purpose: grpcio (and grpcio-status), protobuf, numpy, cbor2 and xxhash; torch only if you
pass tensors.
"""

from kvstored_client import shm
from kvstored_client.buffers import Buffers
from kvstored_client.client import Client
from kvstored_client.contract.errors import (
    DaemonNotRunning,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
)
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.layout import TensorLayout
from kvstored_client.contract.namespace import Namespace
from kvstored_client.errors import ClientClosed
from kvstored_client.results import LoadResult, LookupResult, SaveResult
from kvstored_client.version import __version__

__all__ = [
    "Buffers", "Client", "ClientClosed", "DaemonNotRunning", "DeadlineExceeded", "FailedPrecondition",
    "InvalidArgument", "KVStoreError", "LeaseExpired", "LoadResult", "LookupResult", "Namespace", "NotFound",
    "ResourceExhausted", "SaveResult", "TensorLayout", "__version__", "block_hashes", "shm",
]
