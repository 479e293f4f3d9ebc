"""What the randomized tests of the store, the cluster and the SDK share: the bytes a write stores
(and a block's bytes as a function of its key), the client-side record of leases and sessions, real
daemons restarted and their logs read for trouble, and a runner that sweeps seeds from the command
line."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from conftest import ROOT, Daemon, wait_serving
from kvstored.index import Block


def payload(key: bytes, ns: int, version: int, nbytes: int) -> bytes:
    """Bytes no other write produces: the key, the namespace and a version, repeated."""
    return (key[:7] + bytes([ns]) + version.to_bytes(8, "little")) * (nbytes // 16)


class Broken(AssertionError):
    """An invariant the test checks does not hold (the message names the seed and the last ops)."""


@dataclass
class Tracked:
    """A lease or reservation the test (the client) holds."""

    lease_id: int
    session: str
    ns: int                     # index into the test's namespaces
    keys: list[bytes]           # the blocks it covers, in chain order
    offsets: list[int]
    expected: list[bytes]       # their bytes (reservations: what the client wrote)
    reservation: bool
    born: tuple[float, float]   # the clock when its request started and when it returned
    ttl: float


@dataclass
class ClientSession:
    session_id: str
    buffers: dict[int, tuple[int, Any]] = field(default_factory=dict)   # ns -> (buffers_id, SharedTensor)
    free_rows: dict[int, list[int]] = field(default_factory=dict)       # ns -> free row ranges
    closed: bool = False


def under_ssd(block: Block) -> bool:
    """Whether every ancestor of ``block`` has an SSD copy (what a restart can rebuild it under)."""
    parent = block.parent
    while parent is not None:
        if not parent.on_ssd:
            return False
        parent = parent.parent
    return True


def sweep(run_seed: Callable[[Path, int, int], None], default_steps: int) -> None:
    """``python <test> FIRST COUNT [STEPS] [v]``: run seeds FIRST.. in fresh directories, print each
    failure (whole with ``v``) and the failing seeds."""
    first, count = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else default_steps
    verbose = len(sys.argv) > 4
    failed = []
    for seed in range(first, first + count):
        with tempfile.TemporaryDirectory() as d:
            try:
                run_seed(Path(d), seed, steps)
            except Broken as exc:
                failed.append(seed)
                print(str(exc) if verbose else str(exc).splitlines()[0], flush=True)
            except Exception as exc:
                failed.append(seed)
                print(f"seed {seed}: {exc!r}", flush=True)
    print(f"{count - len(failed)}/{count} passed; failing seeds: {failed}")


# -- real daemons (the SDK and cluster tests) ------------------------------------------------------
_contents: dict[tuple[str, bytes, int], np.ndarray] = {}


def content(tag: str, key: bytes, width: int) -> np.ndarray:
    """The bytes of the block with ``key`` in namespace ``tag``: the model of every block."""
    row = _contents.get((tag, key, width))
    if row is None:
        seed = int.from_bytes(hashlib.blake2b(tag.encode() + key, digest_size=8).digest(), "little")
        row = _contents[(tag, key, width)] = np.random.default_rng(seed).integers(0, 256, width, np.uint8)
    return row


def fill_block(tensors: list[Any], block: int, row: np.ndarray) -> None:
    """Write a block's payload into registered engine tensors of shape (2, blocks, ...) (block
    dimension 1): each tensor's K then V sub-array of the block, in order."""
    half = row.size // len(tensors) // 2
    for i, t in enumerate(tensors):
        for kv in range(2):   # t[kv, block] is contiguous (t[:, block] is not: reshape would copy)
            at = (2 * i + kv) * half
            t.numpy()[kv, block].view(np.uint8).reshape(-1)[:] = row[at: at + half]


def read_block(tensors: list[Any], block: int) -> np.ndarray:
    """The payload of ``block`` in the tensors, as :func:`fill_block` lays it out."""
    return np.concatenate([t.numpy()[kv, block].view(np.uint8).reshape(-1) for t in tensors for kv in range(2)])


def relaunch(d: Daemon, sig: int, stop_timeout: float = 20.0) -> int:
    """Stop ``d`` with ``sig`` (SIGKILL after ``stop_timeout``) and start the same daemon again
    (same socket, same SSD directory); the stopped process's exit status."""
    status = d.stop(sig, stop_timeout)
    with open(d.log_path, "ab") as log:
        log.write(f"\n==== test: stopped with {signal.Signals(sig).name}, restarting ====\n".encode())
        log.flush()
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "KVSTORED_SOCKET")}
        d.proc = subprocess.Popen(d.args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wait_serving(d.socket, d.proc)
    return status


def settle(stats: Callable[[], dict[str, Any]], cond: Callable[[dict[str, Any]], bool],
           timeout: float = 15.0) -> dict[str, Any]:
    """``stats()`` once ``cond`` holds of it, or the last one after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = stats()
        if cond(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def make_prompts(rng: random.Random, n: int, families: int, max_blocks: int) -> list[np.ndarray]:
    """``n`` prompts in ``families`` sharing prefixes (so chains branch), each 1..``max_blocks``
    whole 16-token blocks and sometimes a partial tail."""
    bases = [np.arange(16 * max_blocks) + 1_000_000 * (f + 1) for f in range(families)]
    prompts = []
    for i in range(n):
        base = bases[rng.randrange(len(bases))]
        shared = rng.randrange(0, max_blocks)
        total = rng.randrange(max(1, shared), max_blocks + 1)
        own = np.arange(16 * (total - shared)) + 50_000_000 + 1000 * 16 * i
        tail = np.arange(rng.choice([0, 0, 5])) + 7
        prompts.append(np.concatenate([base[: 16 * shared], own, tail]))
    return prompts


def daemon_trouble(d: Daemon) -> str:
    """The first traceback, assertion or error the daemon logged (grpc's report of a reply to a
    client that had gone is a DEBUG line now: it counts, should it come back)."""
    lines = d.log().splitlines()
    for i, line in enumerate(lines):
        if any(m in line for m in ("Traceback", "AssertionError", " ERROR ", "CRITICAL", "never retrieved")):
            return "\n".join(lines[max(0, i - 5): i + 40])
    return ""
