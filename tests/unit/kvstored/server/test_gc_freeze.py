"""The collector's pauses: long-lived objects frozen after a collection, thawed now and then."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from kvstored.server import gc_freeze


class Node:
    """An object in a reference cycle (only the cyclic collector frees it)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """The rest of the suite runs with nothing frozen."""
    yield
    gc.unfreeze()


def test_freeze_collects_the_garbage_first_and_hides_what_lives_from_later_passes() -> None:
    garbage = weakref.ref(Node())   # unreachable already: must be freed, not frozen
    live = Node()
    assert garbage() is not None
    gc_freeze.freeze()
    assert garbage() is None, "a cycle that was garbage at the freeze was frozen (never to be freed)"
    assert gc.get_freeze_count() > 0
    assert not any(o is live for o in gc.get_objects()), "a live object is still walked by every pass"


def test_a_cycle_that_became_garbage_while_frozen_is_freed_at_the_thaw() -> None:
    node = Node()
    gone = weakref.ref(node)
    gc_freeze.freeze()
    del node
    gc.collect()
    assert gone() is not None   # frozen: kept until the thaw
    gc_freeze.thaw()
    assert gone() is None
    assert gc.get_freeze_count() > 0, "the survivors of the thaw's pass are frozen again"


def test_the_loop_freezes_every_interval_and_thaws_every_thaw_every_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(gc_freeze, "THAW_EVERY", 3)
    monkeypatch.setattr(gc_freeze, "freeze", lambda: calls.append("freeze") or 0.0)
    monkeypatch.setattr(gc_freeze, "thaw", lambda: calls.append("thaw") or 0.0)

    async def run() -> None:
        task = asyncio.ensure_future(gc_freeze.freeze_loop(0.001))
        for _ in range(2000):   # bounded: a few ms of rounds
            if len(calls) >= 6:
                break
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(run())
    assert calls[:6] == ["freeze", "freeze", "thaw", "freeze", "freeze", "thaw"]
