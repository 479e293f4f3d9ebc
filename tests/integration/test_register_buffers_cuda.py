"""register_buffers with a cupy array (review), checked without a GPU: ``cuda_export`` and the
README promise torch *or* cupy, but register_buffers reads the layout with torch's API."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvstored_client import cuda_export
from kvstored_client._proto import kvstored_pb2 as pb


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
