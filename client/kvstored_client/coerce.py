"""A caller's arguments as the SDK sends them: token ids, rows of block bytes, engine block ids
(numpy arrays, torch tensors or plain sequences), or InvalidArgument saying what is wrong."""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstored_client.contract.errors import InvalidArgument

if TYPE_CHECKING:
    from kvstored_client.buffers import Buffers


def token_array(tokens: Any) -> np.ndarray:
    if hasattr(tokens, "detach"):  # torch tensor
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens)


def rows(kv: Any) -> np.ndarray:
    """A (blocks, bytes) uint8 view of ``kv`` without copying; InvalidArgument if it is not one."""
    if hasattr(kv, "detach"):  # torch tensor: view its bytes through numpy
        import torch

        if kv.device.type != "cpu":
            raise InvalidArgument("save/load take CPU tensors; use register_buffers for device memory")
        if kv.dim() < 2:
            raise InvalidArgument(f"kv must have one row per block (at least 2 dimensions); got shape "
                                  f"{tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise InvalidArgument("kv tensor must be contiguous")
        # the row width from the shape, not -1: a reshape cannot infer it for 0 rows
        arr = kv.detach().reshape(kv.shape[0], math.prod(kv.shape[1:])).view(torch.uint8).numpy()
    else:
        arr = np.asarray(kv)
        if arr.ndim < 2:
            # a flat array would be taken as one-byte blocks, and fix the namespace's size at that
            raise InvalidArgument(f"kv must have one row per block (at least 2 dimensions); got shape {arr.shape}")
        if arr.dtype.hasobject:
            raise InvalidArgument(f"kv must hold numbers, not {arr.dtype} objects")
        if not arr.flags.c_contiguous:
            raise InvalidArgument("kv array must be C-contiguous")
        arr = arr.reshape(arr.shape[0], math.prod(arr.shape[1:])).view(np.uint8)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise InvalidArgument("kv must have one non-empty row per block")
    return arr


def writable_rows(out: Any) -> np.ndarray:
    """``out`` as (blocks, bytes) uint8 rows that loads may write into."""
    arr = rows(out)
    if not arr.flags.writeable:
        raise InvalidArgument("out is read-only")
    return arr


def block_start(start: Any) -> int:
    """``start`` (the leading blocks of a chain the caller holds already) as a count of blocks."""
    if isinstance(start, bool) or not isinstance(start, int | np.integer) or start < 0:
        raise InvalidArgument(f"start must be a whole number of blocks >= 0, got {start!r}")
    return int(start)


def block_id_sequence(block_ids: Any) -> Any:
    """``block_ids`` as :func:`set_block_ids` (and ``len``) take them: a torch tensor as numpy, any
    other iterable of ids as a list (an iterator would be used up before a bad id could be
    named). InvalidArgument when it is not a one-dimensional sequence."""
    if hasattr(block_ids, "detach"):   # torch tensor
        block_ids = block_ids.detach().cpu().numpy()
    if isinstance(block_ids, np.ndarray):
        if block_ids.ndim != 1:
            raise InvalidArgument(f"block_ids must be one-dimensional, got shape {block_ids.shape}")
        return block_ids
    if isinstance(block_ids, (bytes, bytearray, str)):
        raise InvalidArgument("block_ids must be a sequence of ints, one per block")
    if isinstance(block_ids, (list, tuple, range, array.array)):
        return block_ids
    try:
        return list(block_ids)
    except TypeError:
        raise InvalidArgument(f"block_ids must be a sequence of ints, one per block; got "
                              f"{type(block_ids).__name__}") from None


def set_block_ids(request: Any, block_ids: Sequence[int], buffers: Buffers | None, packed: bool = True) -> None:
    """Put ``block_ids`` (ints: numpy and torch integers too, and bools as the ints they are)
    into ``request.packed_block_ids``, little-endian uint32s: one field, not 8,192 varints for a
    128k-token prompt, on the way to the first block (``packed`` False: ``block_ids``, for a daemon
    from before). For an id that is not a uint32, InvalidArgument names it. Ids beyond the buffers
    are the daemon's to refuse."""
    if isinstance(block_ids, (bytes, bytearray, str)):
        raise InvalidArgument("block_ids must be a sequence of ints, one per block")
    if packed and isinstance(block_ids, np.ndarray) and block_ids.dtype.kind in "iu" and block_ids.ndim == 1 and (
            not block_ids.size or (block_ids.min() >= 0 and block_ids.max() < 1 << 32)):
        request.packed_block_ids = block_ids.astype("<u4").tobytes()
        return
    try:
        ids = array.array("I", block_ids)
    except (TypeError, ValueError, OverflowError):
        limit = buffers.num_blocks if buffers is not None else 1 << 32
        for i, b in enumerate(block_ids):
            if not isinstance(b, (int, np.integer)) or not 0 <= b < limit:
                raise InvalidArgument(f"block_ids[{i}] = {b!r} is not a block of the buffers "
                                      f"(0..{limit - 1})") from None
        raise InvalidArgument("block_ids must be a sequence of ints, one per block") from None
    if not packed:
        request.block_ids.extend(ids)
        return
    assert ids.itemsize == 4, "array's 'I' is 32 bits on every platform numpy supports"
    if sys.byteorder == "big":
        ids.byteswap()
    request.packed_block_ids = ids.tobytes()
