"""A registered engine tensor as the copy primitives see it: where its blocks lie, and the memory behind it.

Its own module so that the registration (:mod:`kvstored.buffers`) and the copy primitives
(:mod:`kvstored.copy`, :mod:`kvstored.cuda`) share it without importing each other.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from kvstored_client.contract.errors import FailedPrecondition
from kvstored_client.contract.layout import BlockRegion


@dataclass(frozen=True, slots=True)
class TensorMemory:
    """One registered tensor as the copy primitives see it."""

    region: BlockRegion
    part_offset: int          # where its rows start inside a block's payload
    host: np.ndarray | None   # CPU twin: the mapped file as bytes
    base: int                 # byte offset of element 0 in ``host``, or its device address
    mapping: mmap.mmap | None = None   # CPU twin: its mapping (whose own fd tells the file's size)
    end: int = 0              # the bytes of that file the tensor needs

    def check_backing(self, index: int) -> None:
        """FailedPrecondition when the file behind this tensor shrank since it was registered: a
        copy touching a page past its end would raise SIGBUS and kill the daemon."""
        if self.mapping is None:
            return
        size = self.mapping.size()   # fstat of the descriptor mmap keeps: no second one per tensor
        if size < self.end:
            raise FailedPrecondition(f"tensors[{index}]: its shared-memory file shrank to {size} bytes since "
                                     f"it was registered (the tensor needs {self.end}); register the buffers "
                                     "again")
