"""Engine KV buffers registered with the daemon.

Registration turns each tensor descriptor into a :class:`~kvstored_client.contract.layout.BlockRegion` (where
block ``b`` lives, as rows of bytes) over memory the daemon can reach: a shared-memory file here
(the CPU twin), device memory opened from a CUDA IPC handle on a GPU host (``kvstored.cuda``).
Everything above the copy primitive is the same for both.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from kvstored.tensor_memory import TensorMemory
from kvstored_client.contract.errors import InvalidArgument, ResourceExhausted
from kvstored_client.contract.layout import BlockRegion, TensorLayout, layout_signature

# For each block of a chain, the engine buffers' block it goes to or comes from. A numpy array as
# read from a request: a 128k-token prompt's 8,192 ids are not made Python ints on the way in.
BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.uint32]


def _fallocate_call() -> object | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:   # pragma: no cover - no C library to ask
        return None
    for name in ("fallocate64", "fallocate"):
        call = getattr(libc, name, None)
        if call is not None:
            call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            call.restype = ctypes.c_int
            return call
    return None   # pragma: no cover


_FALLOCATE = _fallocate_call()


def allocate_pages(fd: int, offset: int, length: int) -> bool:
    """Back every page of ``offset``..``offset + length`` of ``fd``'s file (fallocate(2), mode 0:
    what is there stays as it is). False when the filesystem cannot (EOPNOTSUPP); OSError otherwise
    (ENOSPC: no room for the pages).

    Not ``os.posix_fallocate``: where the filesystem has no fallocate, glibc emulates it by
    reading a byte of every block and writing a zero back where it read one, which on an engine's
    buffers (written by the engine meanwhile) can zero bytes it just wrote, one syscall or two per
    4 KiB page on the daemon's event loop."""
    if _FALLOCATE is None:   # pragma: no cover - no fallocate in the C library
        return False
    while True:
        if _FALLOCATE(fd, 0, offset, length) == 0:   # type: ignore[operator]
            return True
        err = ctypes.get_errno()
        if err == errno.EINTR:   # a signal while a large range was being filled: go on
            continue
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(err, os.strerror(err))


# Failures of open/mmap that are the daemon's limits (its descriptors, the system's, its address
# space), not the client's input: RESOURCE_EXHAUSTED, as a full tier is.
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


@dataclass(frozen=True, slots=True)
class TensorSource:
    """Where one registered tensor lives: a shm file name and byte offset, or (CUDA) an IPC handle
    of the allocation, the device's UUID and the tensor's byte offset inside the allocation."""

    shm_name: str
    offset: int
    layout: TensorLayout
    cuda_ipc_handle: bytes = b""
    device_uuid: str = ""


class RegisteredBuffers:
    """A set of engine tensors with the same number of blocks, mapped for copying."""

    def __init__(self, buffers_id: int, shm_dir: str, sources: Sequence[TensorSource]) -> None:
        if not sources:
            raise InvalidArgument("register_buffers: no tensors given")
        self.buffers_id = buffers_id
        self.layouts = [s.layout for s in sources]
        self.device = "cpu"
        self.busy = 0                 # requests using them; unregistering waits for zero
        self._maps: list[mmap.mmap] = []
        self._cuda: object | None = None
        self.tensors: list[TensorMemory] = []
        if len({bool(s.cuda_ipc_handle) for s in sources}) > 1:
            # one copy primitive per registration: a shared-memory tensor among CUDA ones would
            # be copied as if its file offset were a device address (and the reverse)
            raise InvalidArgument("register_buffers: all tensors of one registration must be CUDA tensors "
                                  "or all in shared memory")
        for i, src in enumerate(sources):
            try:
                src.layout.validate()
                region = src.layout.region()
            except ValueError as exc:
                self.close()
                raise InvalidArgument(f"tensors[{i}]: {exc}") from None
            part = sum(lay.block_bytes for lay in self.layouts[:i])
            if src.cuda_ipc_handle:
                self.tensors.append(self._open_cuda(i, src, region, part))
            else:
                self.tensors.append(self._map(i, shm_dir, src, region, part))
        counts = {lay.num_blocks for lay in self.layouts}
        if len(counts) != 1:
            self.close()
            raise InvalidArgument(f"register_buffers: tensors disagree on the number of blocks: {sorted(counts)}")
        self.num_blocks = counts.pop()
        self.block_bytes = sum(lay.block_bytes for lay in self.layouts)
        self.signature = layout_signature(self.layouts)

    def _map(self, i: int, shm_dir: str, src: TensorSource, region: BlockRegion, part: int) -> TensorMemory:
        where = f"tensors[{i}]"
        name = src.shm_name
        if not name or "/" in name or name.startswith("."):
            self.close()
            raise InvalidArgument(f"{where}.shm_name: expected a plain file name, got {name!r}")
        try:
            # no symlinks: the daemon's user must not be led to map some other file
            fd = os.open(Path(shm_dir) / name, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            self.close()
            if exc.errno in _OUT_OF_RESOURCES:
                raise ResourceExhausted(f"{where}.shm_name: cannot open {name!r}: {exc.strerror} (the daemon's "
                                        "open files or memory: unregister buffers no longer used)") from None
            raise InvalidArgument(f"{where}.shm_name: cannot open {name!r}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            end = src.offset + src.layout.extent_bytes
            if end > size:
                self.close()
                raise InvalidArgument(f"{where}: tensor extends to byte {end} but {name!r} has {size}")
            try:
                # Back every page the tensor spans: a sparse file on a full tmpfs maps (MAP_POPULATE
                # does not fail), and a copy touching one of its holes raises SIGBUS, killing the daemon.
                # (A filesystem without fallocate is left as it is: never written to from here.)
                allocate_pages(fd, src.offset, src.layout.extent_bytes)
            except OSError as exc:
                self.close()
                if exc.errno == errno.ENOSPC:
                    raise ResourceExhausted(f"{where}: {name!r} has pages not yet allocated and no room for them "
                                            f"in {shm_dir}: {exc.strerror}") from None
                raise InvalidArgument(f"{where}: cannot allocate {name!r}: {exc.strerror or exc}") from None
            # Populate the page tables now: a copy into a page not yet mapped here costs far more.
            # (mmap keeps a dup of fd: check_backing asks it for the file's size before each copy)
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except OSError as exc:
                self.close()
                if exc.errno in _OUT_OF_RESOURCES:
                    raise ResourceExhausted(f"{where}: cannot map {name!r}: {exc.strerror} (the daemon's open "
                                            "files or memory: unregister buffers no longer used)") from None
                raise InvalidArgument(f"{where}: cannot map {name!r}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        self._maps.append(mm)
        return TensorMemory(region, part, np.frombuffer(mm, dtype=np.uint8), src.offset, mm, end)

    def _open_cuda(self, i: int, src: TensorSource, region: BlockRegion, part: int) -> TensorMemory:
        try:
            from kvstored import cuda
        except ImportError as exc:  # pragma: no cover - only on hosts without cupy
            self.close()
            raise InvalidArgument(f"tensors[{i}]: CUDA buffers need cupy on the daemon host ({exc})") from None
        if self._cuda is None:
            try:
                self._cuda = cuda.DeviceMappings(src.device_uuid)
            except cuda.CudaUnavailable as exc:
                self.close()
                raise InvalidArgument(f"tensors[{i}]: {exc}") from None
            self.device = f"cuda:{src.device_uuid}"
        mappings = self._cuda
        assert isinstance(mappings, cuda.DeviceMappings)
        if src.device_uuid != mappings.device_uuid:
            self.close()
            raise InvalidArgument(f"tensors[{i}]: all tensors of one registration must be on one device")
        try:
            address = mappings.open(src.cuda_ipc_handle) + src.offset
        except cuda.CudaUnavailable as exc:
            self.close()
            raise InvalidArgument(f"tensors[{i}]: {exc}") from None
        return TensorMemory(region, part, None, address)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the buffers for a whole request, its lookups and SSD reads too, not only its
        copies: unregistering waits until it is over (else a load that waited for SSD found the
        buffers closed and reported blocks it never copied)."""
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    @property
    def cuda(self) -> object | None:
        """The device mappings (``kvstored.cuda.DeviceMappings``) of a CUDA registration."""
        return self._cuda

    def close(self) -> None:
        """Unmap everything (the caller waited until nothing uses them: ``busy`` is zero)."""
        self.tensors = []
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a copy still holds a view; the mapping goes when it does
        self._maps.clear()
        if self._cuda is not None:
            self._cuda.close()  # type: ignore[attr-defined]
            self._cuda = None
