"""The stream tracker: for one node's event stream, whether a batch is the next one, old, past a
gap or of a new epoch, and whether the node has gone silent. Pure: sequence numbers and a
clock in, a decision out; the subscriber acts on it.

A node starts unknown: its first frame (a batch or a heartbeat) says which epoch it is in, and
the subscriber must rebuild it from the start of that epoch (a replay from batch 0 when the
publisher still keeps it, else a snapshot). Then batches apply in order; one past the next
expected (or a heartbeat saying a later one was sent) is a gap, recovered by a replay from the
one missing (or a snapshot when the replay no longer reaches it); a frame of another epoch means
the daemon restarted: everything known of the node is stale.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from kvstored.events.wire import epoch_of, make_seq


class Action(enum.Enum):
    APPLY = "apply"          # the next batch: apply it
    IGNORE = "ignore"        # already applied (a replay overlapping the live stream)
    RESYNC = "resync"        # unknown node or new epoch: clear it, rebuild from the epoch's start
    RECOVER = "recover"      # a gap: replay from ``expected``


class NodeStream:
    """One node's position in its stream. ``timeout_s``: silence after which it counts as gone."""

    def __init__(self, clock: Callable[[], float], timeout_s: float) -> None:
        self._clock = clock
        self._timeout = timeout_s
        self.epoch: int | None = None
        self.expected: int | None = None   # seq of the next batch to apply (None: not in sync)
        self.last_heard = clock()
        self.gaps = 0
        self.resyncs = 0

    @property
    def in_sync(self) -> bool:
        return self.expected is not None

    def batch(self, seq: int) -> Action:
        """A batch numbered ``seq`` arrived."""
        self.last_heard = self._clock()
        if self.epoch != epoch_of(seq) or self.expected is None:
            return self._resync(seq)
        if seq < self.expected:
            # a stream without epochs (a vLLM engine's) starting again from 0: a restart
            return self._resync(seq) if seq == 0 and self.epoch == 0 else Action.IGNORE
        if seq > self.expected:
            self.gaps += 1
            return Action.RECOVER
        self.expected += 1
        return Action.APPLY

    def heartbeat(self, seq: int) -> Action:
        """A heartbeat saying ``seq`` was the last batch numbered (-1: none yet)."""
        self.last_heard = self._clock()
        if seq < 0:   # nothing sent in this epoch yet: the heartbeat cannot say which
            return Action.IGNORE
        if self.epoch != epoch_of(seq) or self.expected is None:
            return self._resync(seq)
        if seq >= self.expected:
            self.gaps += 1
            return Action.RECOVER
        return Action.IGNORE

    def _resync(self, seq: int) -> Action:
        self.epoch = epoch_of(seq)
        self.expected = None
        self.resyncs += 1
        return Action.RESYNC

    def epoch_start(self) -> int:
        """The seq of the current epoch's first batch."""
        assert self.epoch is not None
        return make_seq(self.epoch, 0)

    def synced(self, next_seq: int) -> None:
        """Everything before ``next_seq`` is applied (a replay or snapshot ended there)."""
        self.epoch = epoch_of(max(next_seq - 1, 0))
        self.expected = next_seq

    def lost(self) -> None:
        """Forget the position (the node was dropped): its next frame resyncs it."""
        self.epoch = None
        self.expected = None

    def silent(self) -> bool:
        """Heard nothing (not even a heartbeat) for longer than the timeout."""
        return self._clock() - self.last_heard > self._timeout
