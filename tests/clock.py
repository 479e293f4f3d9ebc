"""A clock tests move by hand, for code that takes an injected clock."""

from __future__ import annotations


class Clock:
    """Seconds; starts at 1000 and moves only when a test sets or advances ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
