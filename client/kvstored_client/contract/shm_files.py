"""Files in a shared-memory directory that belong to a live process, as the daemon and the SDK make them.

Such a file is named ``<prefix>-<pid>-<random hex>`` and held locked (``flock``, shared) by the
process that made it for as long as it lives: the daemon's arenas and the SDK's buffer files
alike. Whoever finds one whose maker is gone may unlink it (:func:`sweep_dead_owners`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re


def sweep_dead_owners(directory: str, pattern: re.Pattern[str]) -> list[str]:
    """Unlink the files of ``directory`` whose name matches ``pattern`` (group 1: the creating
    process's pid), owned by this user, whose creator no longer exists and that no process holds
    locked (flock: a live owner in another PID namespace has a pid this one cannot see, and a
    pid reused since by another process is still taken for alive). Returns their names. Shared
    by the SDK's buffer files and the daemon's arenas, which are made and locked the same way."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            if _unlink_if_unlocked(entry.path):
                removed.append(entry.name)
        except OSError:
            continue   # alive under another user (EPERM), or the file vanished
    return removed


def _unlink_if_unlocked(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # fails while its owner lives
    except OSError:
        return False
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)
