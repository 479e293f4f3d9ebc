"""Start-up progress: what the daemon is doing before it serves, told to systemd and to the log.

Restoring a large SSD tier (15 to 25 µs a block here: over a minute for 4M blocks) or pre-faulting a
large arena can outlast systemd's start timeout (TimeoutStartSec=, 90 s by default), which would
kill the daemon and restart it into the same restore for ever. Each step and each advance within
one sends ``EXTEND_TIMEOUT_USEC``: systemd waits as long as the start keeps moving, and still
stops a start that hangs (no message within the extension). ``STATUS=`` says what is going on
(``systemctl status kvstored``), and a long step logs its progress now and then. A stop asked for
meanwhile (SIGTERM: ``systemctl stop`` during a long restore) ends the start at its next report,
so the daemon cleans up and exits within seconds, not after the restore (or SIGKILL).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstored.server import sdnotify

log = logging.getLogger("kvstored")

EXTEND_S = 60.0          # a start that sends nothing for this long is taken for hung
NOTIFY_EVERY_S = 1.0     # advances are told to systemd at most this often
LOG_EVERY_S = 10.0       # and logged at most this often


class StartupStopped(Exception):
    """A stop was asked for (SIGTERM, SIGINT) before the daemon served; says during which step."""


class StartupProgress:
    """Reports start-up steps and their advance; ``clock`` (seconds) and ``notify`` (one
    sd_notify message) are injected. Never raises for a failed notification."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 notify: Callable[[str], object] = sdnotify.notify) -> None:
        self._clock = clock
        self._notify = notify
        self._what = ""
        self._notified = float("-inf")
        self._logged = float("-inf")
        self.stop_requested = False   # set from a signal handler: read at each step and advance

    def request_stop(self) -> None:
        """Ask the start to end at its next step or advance (safe from a signal handler)."""
        self.stop_requested = True

    def check(self) -> None:
        """Raise :class:`StartupStopped` when a stop was asked for."""
        if self.stop_requested:
            raise StartupStopped(f"stopped while starting ({self._what or 'before the first step'})")

    def step(self, what: str, expect_s: float = 0.0) -> None:
        """A new step starts: log it and tell systemd, allowing it ``expect_s`` (at least
        EXTEND_S) before the next message (a step that cannot report its advance). Raises
        StartupStopped when a stop was asked for."""
        self.check()
        self._what = what
        now = self._clock()
        self._notified = self._logged = now
        log.info("starting: %s", what)
        self._send(what, max(EXTEND_S, expect_s))

    def advance(self, done: int, total: int = 0) -> None:
        """The current step has done ``done`` of ``total`` items (0: not known yet): told to
        systemd at most every NOTIFY_EVERY_S and logged at most every LOG_EVERY_S. Raises
        StartupStopped when a stop was asked for."""
        self.check()
        now = self._clock()
        if now - self._notified < NOTIFY_EVERY_S:
            return
        self._notified = now
        of = f" of {total:,}" if total else ""
        status = f"{self._what}: {done:,}{of}"
        self._send(status, EXTEND_S)
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.info("starting: %s", status)

    def report(self, what: str, done: int, total: int = 0) -> None:
        """``advance`` of step ``what``, which starts now if it is not the current one (the shape
        of the progress callbacks of :class:`~kvstored.tiers.ssd.SSDTier` and ``restore``)."""
        if what != self._what:
            self.step(what)
        self.advance(done, total)

    def _send(self, status: str, extend_s: float) -> None:
        self._notify(f"STATUS=starting: {status}\nEXTEND_TIMEOUT_USEC={int(extend_s * 1e6)}")
