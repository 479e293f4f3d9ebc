"""Hole punching: give the disk space of a byte range of a file back, keeping the file's size.

Python's ``os`` has ``posix_fallocate`` but not Linux's ``fallocate(2)`` with a mode, which is
what ``FALLOC_FL_PUNCH_HOLE`` needs, so it is called through the C library. A punched range reads
as zeros and is allocated again by the next write into it. Where the call or the mode does not
exist (another OS, a filesystem without holes) :func:`punch_hole` says so and changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
# errnos that mean "this filesystem or kernel cannot punch holes", not "this call failed"
UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):   # no C library by that name, or no fallocate in it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn   # type: ignore[no-any-return]


_fallocate = _libc_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the disk blocks of ``fd``'s bytes ``offset .. offset + length`` (the file's size stays).

    True when done; False when this platform or filesystem cannot punch holes (nothing changed).
    Raises OSError for any other failure (e.g. EIO, EBADF).
    """
    if _fallocate is None:
        return False
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err))
