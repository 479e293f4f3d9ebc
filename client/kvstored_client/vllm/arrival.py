"""The decode engine's wait rule (``kv_role="kv_consumer"``): while a prompt's blocks arrive from a
peer into the local daemon, wait for more of them, or start now on the prefix that has arrived and
compute the rest. Pure: what has arrived, the engine's prefill rate and a time in, a decision out.

The ledger: the first token needs KV for every prompt token, so starting now costs the prefill of
the blocks still missing, and waiting costs their arrival. Waiting pays while blocks arrive faster
than the engine could compute them (their rate observed since the first of them arrived: the
link's fixed cost, paid once, is not its rate); until that rate is known, the engine waits at most
as long as computing the missing blocks would take (so a link that never delivers costs at most
twice the best choice); and never past ``max_wait_s``. The
engine's prefill rate is configured or measured from its own steps (:class:`PrefillMeter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    """Why the engine waits (``WAIT_*``) or starts (the rest)."""

    ALL_LOCAL = "all_local"                     # every block there is to take is local: start on it
    WAIT_ARRIVING_FAST = "wait_arriving_fast"   # blocks arrive faster than the engine computes them
    WAIT_NO_RATE_YET = "wait_no_rate_yet"       # none arrived since the first did; waiting may still pay
    ARRIVING_SLOWLY = "arriving_slowly"         # computing the missing blocks is sooner than their arrival
    NO_ARRIVAL = "no_arrival"                   # no rate within the time computing the missing blocks takes
    MAX_WAIT = "max_wait"                       # the hard cap

    @property
    def waits(self) -> bool:
        return self.name.startswith("WAIT_")


@dataclass(frozen=True, slots=True)
class WaitRule:
    """The engine's side of the ledger: its prefill rate (tokens a second), its block size, and
    the longest a request may wait for arrivals."""

    prefill_tokens_per_s: float
    block_size: int
    max_wait_s: float

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.block_size < 1 or self.max_wait_s < 0:
            raise ValueError(f"bad wait rule {self}")

    def compute_s(self, blocks: int) -> float:
        """Seconds the engine takes to prefill ``blocks`` blocks itself."""
        return blocks * self.block_size / self.prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class Arrival:
    """One prompt's blocks arriving in the local daemon: since ``started``, when ``at_start`` of
    its leading blocks were local and ``target`` will be (local plus what a peer holds, no more
    than the engine may take); at ``observed``, ``local`` were; the first observation with blocks
    arrived was at ``first_at`` (None before), with ``first_local`` local."""

    started: float
    at_start: int
    target: int
    observed: float
    local: int
    first_at: float | None = None
    first_local: int = 0

    def seen(self, at: float, local: int) -> Arrival:
        """The same arrival, observed again."""
        local = max(local, self.local)
        if self.first_at is None and local > self.at_start:
            return Arrival(self.started, self.at_start, self.target, at, local, at, local)
        return Arrival(self.started, self.at_start, self.target, at, local, self.first_at, self.first_local)

    def blocks_per_s(self) -> float:
        """The arrival rate since the first blocks arrived (0 until more came after them)."""
        if self.first_at is None or self.local <= self.first_local or self.observed <= self.first_at:
            return 0.0
        return (self.local - self.first_local) / (self.observed - self.first_at)


def decide(rule: WaitRule, arrival: Arrival, now: float) -> Verdict:
    """Whether the request waits for more blocks (``verdict.waits``) or starts on ``arrival.local``."""
    missing = arrival.target - arrival.local
    if missing <= 0:
        return Verdict.ALL_LOCAL
    if now - arrival.started >= rule.max_wait_s:
        return Verdict.MAX_WAIT
    compute_s = rule.compute_s(missing)
    rate = arrival.blocks_per_s()
    if rate == 0.0:
        return Verdict.WAIT_NO_RATE_YET if now - arrival.started < compute_s else Verdict.NO_ARRIVAL
    # the rest's arrival, counted from the last observation (later ones can only have brought more)
    return Verdict.WAIT_ARRIVING_FAST if missing / rate < compute_s else Verdict.ARRIVING_SLOWLY


@dataclass(slots=True)
class PrefillMeter:
    """The engine's prefill rate as its own steps show it: the tokens a step computed over the
    time until the next step was scheduled (or a request finished), for steps of at least
    ``min_tokens`` (decode steps cost per token far more); each new step weighs ``weight`` in the
    average. ``prior`` until the first such step."""

    prior: float
    min_tokens: int
    weight: float = 0.25
    _rate: float = 0.0
    _open: tuple[float, int] | None = None

    def step_scheduled(self, at: float, tokens: int) -> None:
        """A step of ``tokens`` scheduled at ``at``: the step before it has ended."""
        self.step_ended(at)
        self._open = (at, tokens) if tokens >= self.min_tokens else None

    def step_ended(self, at: float) -> None:
        """The step scheduled last is over by ``at`` (a request it ran finished)."""
        if self._open is None:
            return
        started, tokens = self._open
        self._open = None
        if at > started:
            rate = tokens / (at - started)
            self._rate = rate if not self._rate else self._rate + self.weight * (rate - self._rate)

    @property
    def tokens_per_s(self) -> float:
        return self._rate or self.prior
