"""Tensors in shared memory that the daemon can map: the CPU twin of engine GPU buffers.

``empty(shape, dtype)`` allocates one; ``find(array)`` tells which allocation (file and offset) an
array or tensor view lives in, so ``Client.register_buffers`` can describe it to the daemon.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import math
import mmap
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstored_client.contract.layout import DTYPE_SIZES, TensorLayout
from kvstored_client.contract.shm_files import sweep_dead_owners

SHM_DIR = os.environ.get("KVSTORED_SHM_DIR", "/dev/shm")
# The daemon's group under the systemd unit (systemd/kvstored.sysusers): engines join it.
DAEMON_GROUP = "kvstored"
_live: weakref.WeakValueDictionary[int, SharedTensor] = weakref.WeakValueDictionary()
_BUFFER_NAME = re.compile(r"^kvstored-buf-(\d+)-[0-9a-f]+$")
_swept: set[str] = set()   # directories this process swept of dead engines' buffer files


class SharedTensor:
    """A zero-filled buffer in a shared-memory file, viewable as numpy or (CPU) torch.

    The file is unlinked when the object is closed or collected, and views from :meth:`numpy`
    and :meth:`torch` keep it alive: ``shm.empty(...).torch()`` alone is a tensor that
    ``register_buffers`` finds (and registers again after a daemon restart) for as long as the
    tensor lives. The file is locked (shared) while this process lives; files of processes that
    died without closing theirs (kill -9, an OOM kill) are removed by the next allocation in
    their directory (:func:`sweep_stale_buffers`).
    """

    def __init__(self, shape: tuple[int, ...], dtype: str, shm_dir: str = SHM_DIR) -> None:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        self.shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} has a negative dimension")
        self.dtype = dtype
        self.nbytes = math.prod(self.shape) * DTYPE_SIZES[dtype]
        if shm_dir not in _swept:
            _swept.add(shm_dir)
            sweep_stale_buffers(shm_dir)
        self.name = f"kvstored-buf-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = Path(shm_dir) / self.name
        # Made under a name the sweep ignores, locked, then renamed: no sweep sees it unlocked.
        making = Path(shm_dir) / f".{self.name}.new"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)   # held (fd open) until the file is unlinked
            os.rename(making, self.path)
            _share_with_the_daemon(fd)
            os.ftruncate(fd, max(self.nbytes, 1))
            # Reserve every page: on a full tmpfs the file would stay sparse (MAP_POPULATE does not
            # fail), and the first write to a missing page, ours or the daemon's, is a SIGBUS.
            os.posix_fallocate(fd, 0, max(self.nbytes, 1))
            # Allocate and map every page up front, like an engine's KV pool is at start.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, max(self.nbytes, 1), flags=flags)
        except BaseException:
            _unlink(making)   # no finalizer yet: the file would stay behind
            _unlink(self.path)
            os.close(fd)
            raise
        self.bytes = np.frombuffer(self._mmap, dtype=np.uint8, count=self.nbytes)
        self.base_address = self.bytes.ctypes.data
        _live[self.base_address] = self
        self._finalizer = weakref.finalize(self, _unlink_and_close, self.path, fd)

    def _kept_bytes(self) -> np.ndarray:
        """The buffer's bytes as an array whose base holds this object (views of the mmap alone
        did not: the object, and with it the file and the entry :func:`describe` finds, went
        while the engine's tensors lived on)."""
        return np.asarray(_Keeper(self))

    def numpy(self) -> np.ndarray:
        """The whole buffer as a numpy array (bfloat16 and float8 as same-width unsigned ints)."""
        np_dtype = np.dtype(self.dtype) if self.dtype not in ("bfloat16", "float8_e4m3fn", "float8_e5m2") \
            else np.dtype(f"u{DTYPE_SIZES[self.dtype]}")
        return self._kept_bytes().view(np_dtype).reshape(self.shape)

    def torch(self) -> Any:
        """The whole buffer as a CPU torch tensor sharing this memory (needs torch)."""
        import torch

        t = torch.from_numpy(self._kept_bytes())   # holds the array, which holds this object
        return t.view(getattr(torch, self.dtype)).view(self.shape)

    def close(self) -> None:
        self._finalizer()


class _Keeper:
    """A SharedTensor's bytes for numpy to view (``__array_interface__``): an array made from it
    keeps it as its base, and it keeps the SharedTensor (not the other way round: no cycle)."""

    def __init__(self, owner: SharedTensor) -> None:
        self.owner = owner
        self.__array_interface__ = {"shape": (owner.nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (owner.base_address, False)}


def _daemon_gid() -> int | None:
    """The id of group :data:`DAEMON_GROUP`, or None where there is none (no systemd install)."""
    try:
        return grp.getgrnam(DAEMON_GROUP).gr_gid
    except KeyError:
        return None


def _share_with_the_daemon(fd: int) -> None:
    """Make a new buffer file one the daemon may map read-write: a daemon of another user (the
    systemd unit's kvstored) opens it as a member of its group, so the group gets read and write
    whatever this process's umask, and the file goes to the daemon's group where this process
    may hand it over (it is a member, as README's set-up has it, or root)."""
    os.fchmod(fd, 0o660)
    gid = _daemon_gid()
    if gid is not None and gid != os.fstat(fd).st_gid:
        with contextlib.suppress(OSError):   # not a member (EPERM): the file stays in our own group
            os.fchown(fd, -1, gid)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _unlink_and_close(path: Path, fd: int) -> None:
    _unlink(path)
    os.close(fd)   # and the lock with it


def sweep_stale_buffers(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink buffer files left by processes that died without closing them (kill -9, an OOM
    kill: GiBs of an engine's KV pool stayed in ``/dev/shm`` for good); see
    :func:`sweep_dead_owners`. Returns their names."""
    return sweep_dead_owners(shm_dir, _BUFFER_NAME)


def empty(shape: tuple[int, ...] | list[int], dtype: str = "float16") -> SharedTensor:
    """Allocate a zero-filled shared-memory tensor the daemon can map."""
    return SharedTensor(tuple(shape), dtype)


@dataclass(frozen=True, slots=True)
class Placement:
    shm_name: str
    offset: int
    layout: TensorLayout


def describe(array: Any, block_dim: int) -> Placement:
    """Where ``array`` (numpy array or CPU torch tensor, possibly a view) lives in shared memory.

    Raises ValueError when it is not inside a live :class:`SharedTensor` of this process.
    """
    address, shape, strides, dtype = _array_info(array)
    for base, owner in list(_live.items()):
        if base <= address < base + owner.nbytes:
            if owner.dtype in _NUMPY_STAND_INS and dtype == _NUMPY_STAND_INS[owner.dtype]:
                dtype = owner.dtype   # numpy() shows these as same-width uints: same bytes, same layout
            layout = TensorLayout(shape, strides, dtype, block_dim)
            layout.validate()
            if address - base + layout.extent_bytes > owner.nbytes:
                raise ValueError("tensor extends past its shared-memory buffer")
            return Placement(owner.name, address - base, layout)
    raise ValueError("tensor is not in shared memory: allocate it with kvstored.shm.empty() "
                     "(CUDA tensors need the cuda extra)")


_NUMPY_STAND_INS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def _array_info(array: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], str]:
    if isinstance(array, np.ndarray):
        item = array.itemsize
        if any(s % item for s in array.strides):
            raise ValueError("strides must be whole elements")
        return (array.ctypes.data, tuple(array.shape), tuple(s // item for s in array.strides),
                _numpy_dtype_name(array.dtype))
    # torch.Tensor, duck-typed so torch stays optional
    if hasattr(array, "data_ptr") and hasattr(array, "stride"):
        if array.device.type != "cpu":
            raise ValueError(f"{array.device} tensors need the CUDA path (cuda extra)")
        name = str(array.dtype).removeprefix("torch.")
        return array.data_ptr(), tuple(array.shape), tuple(array.stride()), name
    raise TypeError(f"expected a numpy array or torch tensor, got {type(array).__name__}")


def _numpy_dtype_name(dtype: np.dtype) -> str:
    name = str(dtype)
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {name}")
    return name
