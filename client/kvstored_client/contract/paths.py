"""Where the daemon listens by default; shared by the daemon and the SDK so both agree."""

from __future__ import annotations

import os
import stat
from pathlib import Path

SYSTEM_SOCKET = "/run/kvstored/kvstored.sock"
# sun_path holds 108 bytes with its terminating NUL on Linux
MAX_SOCKET_PATH_BYTES = 107


def socket_path_problem(path: str) -> str:
    """Why no Unix socket can live at ``path`` ("" when one can): its length, which the kernel
    caps and which a long TMPDIR or user name reaches sooner than one expects."""
    n = len(os.fsencode(path))
    if n <= MAX_SOCKET_PATH_BYTES:
        return ""
    return (f"the socket path {path} is {n} bytes; a Unix socket's path may have at most {MAX_SOCKET_PATH_BYTES} "
            "(choose a shorter directory)")


def default_socket_path() -> str:
    """``$KVSTORED_SOCKET``, else ``$XDG_RUNTIME_DIR/kvstored/kvstored.sock``, else
    ``/tmp/kvstored-$UID/kvstored.sock`` (the daemon's embedded default)."""
    if env := os.environ.get("KVSTORED_SOCKET"):
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return str(Path(runtime) / "kvstored" / "kvstored.sock")
    return f"/tmp/kvstored-{os.getuid()}/kvstored.sock"


def discover_socket_path() -> str:
    """The socket a client should try: the user default if it exists in a directory of this user
    (or root), else the systemd one if it exists, else the user default (so the error message
    names where the daemon would listen)."""
    user = default_socket_path()
    if os.environ.get("KVSTORED_SOCKET"):
        return user
    planted = False
    if os.path.exists(user):
        if _ours(os.path.dirname(user)):
            return user
        planted = True   # another user's directory at our default name: never connect there
    if os.path.exists(SYSTEM_SOCKET) or planted:
        return SYSTEM_SOCKET
    return user


def _ours(directory: str) -> bool:
    """``directory`` belongs to this user or root: /tmp/kvstored-$UID is a name any local user
    can create first (the daemon refuses such a directory too)."""
    try:
        # the link's owner too, where it is one: anyone may plant one in /tmp (the daemon's
        # _prepare_socket judges the same two owners)
        link = os.lstat(directory)
        st = os.stat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and link.st_uid in (os.getuid(), 0) and st.st_uid in (os.getuid(), 0)
