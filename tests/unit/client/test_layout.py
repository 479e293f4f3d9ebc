"""Layouts of engine KV tensors: which bytes make up block b (what the daemon copies)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstored_client.contract.layout import BlockRegion, TensorLayout, layout_signature


def _layout(arr: np.ndarray, block_dim: int) -> TensorLayout:
    return TensorLayout(arr.shape, tuple(s // arr.itemsize for s in arr.strides), str(arr.dtype), block_dim)


def _block_bytes(arr: np.ndarray, region: BlockRegion, b: int) -> bytes:
    """Block b read as the daemon does: ``height`` rows of ``width`` bytes, ``pitch`` apart."""
    raw = np.frombuffer(arr.tobytes(), np.uint8)
    start = b * region.block_stride
    return b"".join(raw[start + r * region.pitch: start + r * region.pitch + region.width].tobytes()
                    for r in range(region.height))


@pytest.mark.parametrize(("shape", "block_dim"), [
    ((2, 6, 16, 2, 8), 1),      # vLLM: (K/V, num_blocks, block_size, heads, head_dim) per layer
    ((6, 2, 16, 2, 8), 0),      # block-first
    ((6, 3, 2, 16, 2, 8), 0),   # SGLang-style: all layers in one buffer
])
def test_a_blocks_region_holds_exactly_its_sub_tensor(shape: tuple[int, ...], block_dim: int) -> None:
    arr = np.arange(int(np.prod(shape)), dtype=np.float16).reshape(shape)
    layout = _layout(arr, block_dim)
    layout.validate()
    region = layout.region()
    assert layout.num_blocks == 6 and region.width * region.height == layout.block_bytes
    for b in range(6):
        want = np.ascontiguousarray(np.take(arr, b, axis=block_dim)).tobytes()
        assert _block_bytes(arr, region, b) == want, f"block {b}"


def test_a_layout_with_non_contiguous_block_rows_is_refused() -> None:
    arr = np.zeros((2, 6, 16, 2, 8), np.float16)[..., ::2]   # every other head_dim element
    with pytest.raises(ValueError, match="contiguous"):
        _layout(arr, 1).region()


@pytest.mark.parametrize(("layout", "needle"), [
    (TensorLayout((4, 8), (8, 1), "complex64", 0), "unsupported dtype"),
    (TensorLayout((4, 8), (8,), "float16", 0), "equal length"),
    (TensorLayout((4, 0), (8, 1), "float16", 0), "non-positive"),
    (TensorLayout((4, 8), (8, -1), "float16", 0), "non-negative"),
    (TensorLayout((4, 8), (8, 1), "float16", 2), "block_dim"),
])
def test_validate_names_what_is_wrong(layout: TensorLayout, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        layout.validate()


def test_the_signature_tells_byte_orders_apart_not_block_counts() -> None:
    flash = TensorLayout((2, 4, 16, 2, 8), (2048, 512, 16, 8, 1), "float16", 1)
    more_blocks = TensorLayout((2, 9, 16, 2, 8), (4608, 512, 16, 8, 1), "float16", 1)
    token_first = TensorLayout((4, 16, 2, 2, 8), (512, 32, 16, 8, 1), "float16", 0)
    assert layout_signature([flash]) == layout_signature([more_blocks])
    assert layout_signature([flash]) != layout_signature([token_first])
    assert layout_signature([flash, flash]) != layout_signature([flash])
