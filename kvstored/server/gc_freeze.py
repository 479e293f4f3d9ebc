"""Keeping the cyclic garbage collector's pauses short while the index holds millions of blocks.

Every block, its index entry and its policy's record are long-lived objects the collector tracks;
a full pass walks all of them (~200 ms for a million blocks on a 2-core VM) with the event loop
stopped, and Python starts one by itself each time the long-lived objects have grown by a quarter.
``gc.freeze`` moves the objects alive now out of the collector's sight (they are still freed by
their reference counts, as blocks leaving the index are), so later passes walk only what came
since. Garbage is collected right before each freeze, so none is frozen; what was alive when it was
frozen and later becomes unreachable in a cycle (a finished client session's call objects, say)
is kept until the next thaw, when everything goes back to the collector for one full pass.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("kvstored.heap")

THAW_EVERY = 60   # freezes between thaws: with the default interval, one full pass an hour
SLOW_PAUSE_S = 0.05   # a pause longer than this is logged at info


def freeze() -> float:
    """Collect what is not frozen yet, then freeze what survived; the pause, in seconds."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start


def thaw() -> float:
    """Give every frozen object back to the collector and make one full pass (the cycles that
    became garbage while frozen are freed), then freeze the survivors again; the pause."""
    start = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start


async def freeze_loop(interval_s: float) -> None:
    """Every ``interval_s``: :func:`freeze`, and every THAW_EVERY times :func:`thaw`. Runs until
    cancelled; each pause is logged (at info when it is long)."""
    rounds = 0
    while True:
        await asyncio.sleep(interval_s)
        rounds += 1
        full = rounds % THAW_EVERY == 0
        pause = thaw() if full else freeze()
        log.log(logging.INFO if pause > SLOW_PAUSE_S else logging.DEBUG,
                "garbage collection %s: %.1f ms, %d object(s) frozen", "with a thaw" if full else "and freeze",
                pause * 1e3, gc.get_freeze_count())
