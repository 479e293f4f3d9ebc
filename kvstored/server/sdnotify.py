"""systemd readiness protocol: one datagram to $NOTIFY_SOCKET per state change.

Written here rather than depending on a library: the protocol is a single sendto, and the
available packages either need libsystemd headers to build or are unmaintained.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") if systemd asked for notifications; True when sent.

    Never blocks: the caller is the event loop. When the listener's queue is full (it is not
    reading, and a datagram socket queues only ``net.unix.max_dgram_qlen`` messages, 10 by
    default) the message is dropped and False returned; a blocking send would stall every call
    the daemon serves until the listener read again (watchdog pings fill the queue in a second).
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
        try:
            sock.connect(address)
            sock.send(state.encode())
        except OSError:   # BlockingIOError (queue full) included
            return False
    return True


def watchdog_interval_s() -> float | None:
    """Half the watchdog timeout systemd set for this process, or None when there is none."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
