"""A registered shared-memory file shrunk after registration (review): the daemon mapped the size
it saw at registration and copies from it later; a page past the new end of a tmpfs file raises
SIGBUS in the daemon, which kills it (every client of the node loses its cache)."""

from __future__ import annotations

import os

import numpy as np

import kvstored


def test_a_buffer_file_shrunk_after_registration_does_not_kill_the_daemon(daemon) -> None:  # type: ignore[no-untyped-def]
    c = kvstored.Client(daemon.socket)
    buf = kvstored.shm.empty((4, 2, 16, 2, 8), "float16")
    buffers = c.register_buffers([buf.numpy()], block_dim=0)
    os.truncate(buf.path, 0)          # an engine that resizes or recycles its pool file
    try:
        c.save_blocks(buffers, block_ids=[0, 1], tokens=np.arange(32))
    except kvstored.KVStoreError:
        pass                          # refusing the save is fine
    assert daemon.proc.poll() is None, f"daemon died: {daemon.proc.returncode}"
    c.close()
