"""Layout descriptors of engine KV tensors: which bytes make up block ``b``.

A block's payload is, for each registered tensor in order, that tensor indexed at ``b`` along its
block dimension, in C order. Shared by the SDK (to describe buffers) and the daemon (to copy).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Item sizes by dtype name; the daemon copies bytes, so only the width matters to it.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """One KV tensor: ``shape`` and ``strides`` (in elements), dtype name, block dimension."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    block_dim: int

    def validate(self) -> None:
        """Raise ValueError naming what is wrong with this descriptor."""
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(DTYPE_SIZES)}")
        if not self.shape or len(self.shape) != len(self.strides):
            raise ValueError("shape and strides must be non-empty and of equal length")
        if any(d <= 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} has a non-positive dimension")
        if any(s < 0 for s in self.strides):
            raise ValueError(f"strides {self.strides} must be non-negative")
        if not 0 <= self.block_dim < len(self.shape):
            raise ValueError(f"block_dim {self.block_dim} out of range for {len(self.shape)} dimensions")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[: self.block_dim] + self.shape[self.block_dim + 1:]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    @property
    def extent_bytes(self) -> int:
        """Bytes from the tensor's first element to one past its last."""
        return (sum((d - 1) * s for d, s in zip(self.shape, self.strides)) + 1) * self.itemsize

    def signature(self) -> str:
        return f"{self.dtype}{list(self.block_shape)}"

    def region(self) -> BlockRegion:
        """Where block ``b`` lives as a 2-D byte region (see :class:`BlockRegion`).

        Raises ValueError unless the dimensions after the block dimension are C-contiguous and
        those before it collapse into one stride: true of vLLM's, SGLang's and block-first
        layouts, and what lets a GPU move a block with one 2-D copy per tensor.
        """
        item = self.itemsize
        d = self.block_dim
        expected = 1
        for size, stride in zip(reversed(self.shape[d + 1:]), reversed(self.strides[d + 1:])):
            if size > 1 and stride != expected:
                raise ValueError(f"dimensions after block_dim must be contiguous (strides {self.strides})")
            expected *= size
        width = expected * item
        lead = [(s, t) for s, t in zip(self.shape[:d], self.strides[:d]) if s > 1]
        height = math.prod(s for s, _ in lead) if lead else 1
        pitch = lead[-1][1] * item if lead else width
        for (_, outer_stride), (inner, inner_stride) in itertools.pairwise(lead):
            if outer_stride != inner_stride * inner:
                raise ValueError(f"dimensions before block_dim must collapse into one stride ({self.strides})")
        if height > 1 and pitch < width:
            raise ValueError("rows of a block overlap")
        block_stride = self.strides[d] * item
        if self.num_blocks > 1 and block_stride < width:
            # (a broadcast tensor's stride 0, say) every copy into block b would also write into
            # block b + 1: a load into distinct blocks overwrites one with the next
            raise ValueError(f"blocks overlap: the stride of block_dim ({self.strides[d]}) is smaller than "
                             f"a row of a block ({width // item} elements)")
        return BlockRegion(width, height, pitch, block_stride)


@dataclass(frozen=True, slots=True)
class BlockRegion:
    """Block ``b`` of a tensor: ``height`` rows of ``width`` bytes, ``pitch`` bytes apart, the first
    at byte ``b * block_stride``. Its payload part is the rows back to back (``width * height``)."""

    width: int
    height: int
    pitch: int
    block_stride: int


def layout_signature(tensors: Sequence[TensorLayout]) -> str:
    """A string naming the block payload's byte order; equal signatures mean interchangeable blocks."""
    return "+".join(t.signature() for t in tensors)
