"""Engine KV buffers registered with the daemon (``Client.register_buffers``): how tensors are
described to it, and the handle an engine keeps, which outlives a daemon restart."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstored_client import cuda_export, shm
from kvstored_client.contract.errors import InvalidArgument
from kvstored_client.contract.layout import TensorLayout, layout_signature
from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.proto import kvstored_pb2 as pb

if TYPE_CHECKING:
    from kvstored_client.connection import Connection


@dataclass(slots=True, eq=False)
class Registration:
    """What ``register_buffers`` sent, and the id the daemon gave it in which session: a
    registration belongs to a session, so after a restart the SDK registers the tensors again."""

    client: Connection   # the one whose sessions the ids belong to
    tensors: tuple[pb.TensorDesc, ...]
    current: tuple[str, int]   # (session id, buffers id): one attribute, read without the lock
    registered: bool = True   # False once unregistered
    # held by the one thread registering these buffers again (or unregistering them); others wait
    # for it within their own timeout_s, never for every other thread's RPC in turn
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, slots=True, eq=False)
class Buffers:
    """A registration of engine KV tensors with the daemon. It lives through a daemon restart:
    the SDK registers the tensors again with the new daemon on their next use."""

    num_blocks: int
    block_bytes: int
    layout: str
    namespace: Namespace
    num_tensors: int
    _registration: Registration = field(repr=False)

    @property
    def buffers_id(self) -> int:
        """The daemon's id for this registration in the client's current session."""
        return self._registration.current[1]


def describe_tensors(tensors: Sequence[Any], block_dim: int | Sequence[int]) -> tuple[list[pb.TensorDesc], str]:
    """The daemon's descriptors of ``tensors`` (CUDA tensors by IPC handle, others by their
    shared-memory file) and their layout signature; InvalidArgument for what cannot be registered."""
    if isinstance(tensors, (np.ndarray, shm.SharedTensor)) or hasattr(tensors, "data_ptr") \
            or hasattr(tensors, "__cuda_array_interface__"):
        # iterated, its slices along dimension 0 (vLLM's K and V halves) would each be
        # registered as a tensor of its own: a layout of other blocks than the engine's
        raise InvalidArgument("tensors must be a list of tensors (one buffer of all layers too: "
                              f"[buffer]), got a single {type(tensors).__name__}")
    try:
        tensors = list(tensors)
        dims = [block_dim] * len(tensors) if isinstance(block_dim, (int, np.integer)) else list(block_dim)
    except TypeError as exc:
        raise InvalidArgument(f"tensors must be a list of tensors and block_dim an int or one per tensor: "
                              f"{exc}") from None
    if len(dims) != len(tensors):
        raise InvalidArgument("one block_dim per tensor")
    for i, dim in enumerate(dims):
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise InvalidArgument(f"block_dim of tensors[{i}] must be an int, got {dim!r}")
    dims = [int(dim) for dim in dims]
    descs, layouts = [], []
    for i, (t, dim) in enumerate(zip(tensors, dims)):
        try:
            if cuda_export.is_cuda(t):
                dev = cuda_export.export(t)
                layout = TensorLayout(*cuda_export.layout_info(t), dim)
                layout.validate()
                desc = pb.TensorDesc(offset=dev.offset, cuda_ipc_handle=dev.handle,
                                     device_uuid=dev.device_uuid)
            else:
                place = shm.describe(t, dim)
                layout = place.layout
                desc = pb.TensorDesc(shm_name=place.shm_name, offset=place.offset)
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"tensors[{i}]: {exc}") from None
        desc.shape.extend(layout.shape)
        desc.strides.extend(layout.strides)
        desc.dtype, desc.block_dim = layout.dtype, dim
        descs.append(desc)
        layouts.append(layout)
    return descs, layout_signature(layouts)
