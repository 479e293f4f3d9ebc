"""LoadHandle (``Client.load_blocks(wait=False)``) against a scripted call."""

from __future__ import annotations

import threading

import pytest

import kvstored
from kvstored_client.streams import LoadHandle


def test_a_wait_that_times_out_raises_an_sdk_error() -> None:
    """(review) README: every SDK failure is a KVStoreError subclass; LoadHandle's wait,
    wait_layer and result with a timeout raised the builtin TimeoutError instead, which an
    engine catching KVStoreError (to recompute) let through. DeadlineExceeded is both."""
    release = threading.Event()

    class Call:
        def __iter__(self):  # type: ignore[no-untyped-def]
            release.wait(30)   # a load the daemon has not reported on yet
            return iter(())

        def cancel(self) -> None:
            release.set()

    handle = LoadHandle(Call(), 16, 2)
    try:
        for wait in (lambda: handle.wait(timeout=0.01), lambda: handle.wait_layer(1, timeout=0.01)):
            with pytest.raises(kvstored.DeadlineExceeded, match="still in progress") as info:
                wait()
            assert isinstance(info.value, kvstored.KVStoreError) and isinstance(info.value, TimeoutError)
    finally:
        release.set()
