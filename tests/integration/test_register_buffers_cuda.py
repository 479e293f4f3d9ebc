"""register_buffers with a cupy array (review), checked without a GPU: ``cuda_export`` and the
README promise torch *or* cupy, but register_buffers reads the layout with torch's API."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvstored_client import cuda_export
from kvstored_client.contract.proto import kvstored_pb2 as pb


class CupyLikeArray:
    """What register_buffers sees of a ``cupy.ndarray``: numpy-style ``shape``, ``strides`` in
    bytes and ``dtype``; ``device`` is a cupy Device (an ``id``, no ``type``); no ``stride()``."""

    __module__ = "cupy._core.core"

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        model = np.empty(shape, dtype)[:, :, :, :, ::2]    # a strided view, as engines slice
        self.shape, self.strides, self.dtype = model.shape, model.strides, model.dtype
        self.device = SimpleNamespace(id=0)


def test_a_cupy_array_registers_with_its_strides_in_elements(client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Was: ``t.stride()`` (torch only) raised AttributeError out of register_buffers for every
    cupy array; the layout it should send is cupy's byte strides divided by the item size."""
    monkeypatch.setattr(cuda_export, "export",
                        lambda t: cuda_export.DeviceExport(b"\0" * 64, 0, "GPU-0000"))
    sent: list[pb.RegisterBuffersRequest] = []
    real_call = client._call

    def call(method: Any, request: Any) -> Any:
        if isinstance(request, pb.RegisterBuffersRequest):
            sent.append(request)
            raise RuntimeError("stop before the daemon (it has no GPU here)")
        return real_call(method, request)

    monkeypatch.setattr(client, "_call", call)
    arr = CupyLikeArray((2, 4, 16, 2, 16), "float16")
    with pytest.raises(RuntimeError, match="stop before"):
        client.register_buffers([arr], block_dim=1)
    (desc,) = sent[0].tensors
    assert list(desc.shape) == [2, 4, 16, 2, 8]
    assert list(desc.strides) == [s // 2 for s in arr.strides]
    assert desc.dtype == "float16"


def test_a_cupy_array_from_the_memory_pool_is_exported_at_its_offset_in_the_allocation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Review: the offset was taken from cupy's pool chunk (``data.mem.ptr``), but the IPC handle
    opens the whole CUDA allocation the pool carved the chunk from: an array not at the start of
    that allocation was registered at the wrong place, and the daemon copied other memory."""
    import sys
    import types

    allocation, chunk, array_at = 0x7F00_0000_0000, 0x7F00_0040_0000, 0x7F00_0040_1000
    asked: list[int] = []
    devices: list[int] = []
    runtime = types.SimpleNamespace(ipcGetMemHandle=lambda p: asked.append(p) or b"\1" * 64,
                                    getDeviceProperties=lambda i: devices.append(i) or {"uuid": b"\2" * 16})
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda: SimpleNamespace(id=0))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)  # type: ignore[attr-defined]
    monkeypatch.setattr(cuda_export, "_allocation_base", lambda p: allocation if p >= allocation else p)
    arr = CupyLikeArray((2, 4, 16, 2, 16), "float16")
    arr.data = SimpleNamespace(ptr=array_at, mem=SimpleNamespace(ptr=chunk))  # type: ignore[attr-defined]
    arr.device = SimpleNamespace(id=3)   # not the current device (0): its UUID is the one to send
    exported = cuda_export.export(arr)
    assert asked == [allocation]
    assert exported.offset == array_at - allocation
    assert devices == [3]
