"""The decode engine's wait rule (``kv_role="kv_consumer"``): while a prompt's blocks arrive from a
peer into the local daemon, wait for more of them, or start now on the prefix that has arrived and
compute the rest. Pure: what has arrived, the engine's prefill rate and a time in, a decision out.

The ledger: the first token needs KV for every prompt token, so starting now costs the prefill of
the blocks still missing, and waiting costs their arrival. Waiting pays while blocks arrive faster
than the engine could compute them (their rate is observed from the arrivals so far); before any
has arrived, the engine waits at most as long as computing the missing blocks would take (so a link
that never delivers costs at most twice the best choice); and never past ``max_wait_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    """Why the engine waits (``WAIT_*``) or starts (the rest)."""

    ALL_LOCAL = "all_local"                     # every block there is to take is local: start on it
    WAIT_ARRIVING_FAST = "wait_arriving_fast"   # blocks arrive faster than the engine computes them
    WAIT_FIRST_BLOCK = "wait_first_block"       # none arrived yet, and waiting may still pay
    ARRIVING_SLOWLY = "arriving_slowly"         # computing the missing blocks is sooner than their arrival
    NO_ARRIVAL = "no_arrival"                   # none arrived within the time computing them would take
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
    than the engine may take); at ``observed``, ``local`` were."""

    started: float
    at_start: int
    target: int
    observed: float
    local: int

    def seen(self, at: float, local: int) -> Arrival:
        """The same arrival, observed again."""
        return Arrival(self.started, self.at_start, self.target, at, max(local, self.local))

    def blocks_per_s(self) -> float:
        """The arrival rate so far (0 before the first block); the time to the first block counts,
        so a link's latency is in it."""
        arrived = self.local - self.at_start
        elapsed = self.observed - self.started
        if arrived <= 0 or elapsed <= 0:
            return 0.0 if arrived <= 0 else float("inf")
        return arrived / elapsed


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
        return Verdict.WAIT_FIRST_BLOCK if now - arrival.started < compute_s else Verdict.NO_ARRIVAL
    # the rest's arrival, counted from the last observation (later ones can only have brought more)
    return Verdict.WAIT_ARRIVING_FAST if missing / rate < compute_s else Verdict.ARRIVING_SLOWLY
