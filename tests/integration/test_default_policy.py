"""A daemon on the default eviction policy (glide) serves what it keeps with the right bytes
and evicts to stay within its tier: reused prompts survive a stream of one-off saves."""

from __future__ import annotations

import numpy as np

import kvstored
from kvstored.policy.registry import DEFAULT_POLICY


def rows(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=(n, width), dtype=np.uint8)


def test_the_default_policy_serves_and_evicts(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    assert DEFAULT_POLICY == "glide"
    # the test daemon has a 64 MiB arena in 1 MiB pages; blocks of 256 KiB -> 256 slots
    d = daemon_factory("--set", "ssd.enabled=false")
    client = kvstored.Client(d.socket)
    width = 256 << 10
    hot = [np.arange(16 * 16) + 7_000_000 * (h + 1) for h in range(4)]
    for h, tokens in enumerate(hot):
        client.save(tokens, rows(16, width, seed=1000 + h))
    for i in range(40):   # 40 x 16 one-off blocks through a 256-block tier, the hot prompts read between
        tokens = np.arange(16 * 16) + 100_000 * (i + 1)
        client.save(tokens, rows(16, width, seed=i))
        for h, hot_tokens in enumerate(hot):
            found = client.lookup(hot_tokens)
            assert found.blocks == 16, f"hot prompt {h} lost after save {i}"
    st = client.stats()
    tier = st["tiers"][0]
    assert int(tier["evictions"]) >= 40 * 16 + 4 * 16 - 256
    assert int(tier["used_bytes"]) <= int(tier["capacity_bytes"])
    for h, tokens in enumerate(hot):   # what it kept, it serves with the bytes saved
        assert np.array_equal(client.load(tokens).data, rows(16, width, seed=1000 + h))
    newest = np.arange(16 * 16) + 100_000 * 40
    assert np.array_equal(client.load(newest).data, rows(16, width, seed=39))
    assert client.lookup(np.arange(16 * 16) + 100_000).blocks == 0   # the oldest one-off went
    client.close()
