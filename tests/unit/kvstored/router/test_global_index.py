"""The global index and its block table against a plain dict model; the stream tracker's rules."""

from __future__ import annotations

import random

import numpy as np

from kvstored.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, make_seq
from kvstored.router.index import GlobalIndex
from kvstored.router.stream import Action, NodeStream
from kvstored.router.table import BlockTable


def test_the_table_matches_a_dict_through_random_changes() -> None:
    table = BlockTable(4, 16)
    model: dict[tuple[int, int], int] = {}
    rng = random.Random(7)
    for step in range(1500):
        keys = np.array([rng.choice([rng.getrandbits(64), rng.randint(0, 300)]) for _ in range(rng.randint(1, 40))],
                        np.uint64)
        column, bit = rng.randrange(4), 1 << rng.randrange(3)
        r = rng.random()
        if r < 0.6:
            table.set_bits(keys, column, bit)
            for k in keys.tolist():
                model[(k or 1, column)] = model.get((k or 1, column), 0) | bit
        elif r < 0.97:
            table.clear_bits(keys, column, bit)
            for k in keys.tolist():
                if (k or 1, column) in model:
                    model[(k or 1, column)] &= ~bit
        else:
            table.clear_column(column)
            model = {kc: (0 if kc[1] == column else v) for kc, v in model.items()}
        if step % 50 == 0:
            probe = np.array(sorted({k for k, _ in model} | {424242}), np.uint64)
            rows = table.rows(probe)
            want = np.array([[model.get((k, c), 0) for c in range(4)] for k in probe.tolist()], np.uint8)
            assert (rows == want).all(), step
    assert table.entries() == sum(1 for v in model.values() if v)


def test_holdings_per_node_and_tier_and_namespace() -> None:
    index = GlobalIndex()
    chain = list(range(100, 110))
    index.apply("a", [BlockStored(tuple(chain[:6]), None, 16, "CPU", namespace_id=5),
                      BlockStored(tuple(chain[:3]), None, 16, "DISK", namespace_id=5)])
    index.apply("b", [BlockStored(tuple(chain), None, 16, "DISK", namespace_id=5),
                      BlockRemoved((chain[4],), "DISK", namespace_id=5)])
    index.apply("c", [BlockStored(tuple(chain), None, 16, "GPU")], namespace_id=5)   # an engine's events
    index.apply("d", [BlockStored(tuple(chain), None, 16, "CPU", namespace_id=6)])  # another namespace
    h = index.holdings(5, chain)
    assert h.nodes == ("a", "b", "c", "d")
    assert h.prefix.tolist() == [6, 4, 10, 0]
    assert (h.gpu.tolist(), h.dram.tolist(), h.ssd.tolist()) == ([0, 0, 10, 0], [6, 0, 0, 0], [0, 4, 0, 0])
    # 32-byte hashes name the same blocks by their last 8 bytes
    assert index.holdings(5, [h.to_bytes(8, "big") * 4 for h in chain]).prefix.tolist() == [6, 4, 10, 0]
    # within a batch the last change wins; AllBlocksCleared empties the node at its place in the batch
    index.apply("c", [BlockRemoved((chain[0],), "GPU"), BlockStored((chain[0],), None, 16, "GPU"),
                      AllBlocksCleared(), BlockStored(tuple(chain[:2]), None, 16, "GPU"),
                      BlockRemoved((chain[1],), "GPU")], namespace_id=5)
    assert index.holdings(5, chain).prefix.tolist() == [6, 4, 1, 0]
    index.drop("a")
    assert index.nodes() == ["b", "c", "d"]
    index.apply("e", [BlockStored((chain[0],), None, 16, "CPU", namespace_id=5)])   # takes a's column, empty
    assert index.holdings(5, chain).prefix.tolist() == [4, 1, 0, 1]


def test_the_stream_tracker_applies_in_order_and_asks_for_recovery() -> None:
    now = [0.0]
    s = NodeStream(lambda: now[0], timeout_s=3.0)
    assert s.batch(make_seq(7, 4)) is Action.RESYNC and s.epoch_start() == make_seq(7, 0)
    s.synced(make_seq(7, 5))
    assert s.batch(make_seq(7, 3)) is Action.IGNORE
    assert s.batch(make_seq(7, 5)) is Action.APPLY
    assert s.batch(make_seq(7, 7)) is Action.RECOVER and s.expected == make_seq(7, 6)
    s.synced(make_seq(7, 8))
    assert s.heartbeat(make_seq(7, 7)) is Action.IGNORE
    assert s.heartbeat(make_seq(7, 8)) is Action.RECOVER     # a lost tail, seen on an idle stream
    assert s.heartbeat(make_seq(9, 0)) is Action.RESYNC      # the daemon restarted
    now[0] = 2.0
    assert not s.silent()
    now[0] = 5.5
    assert s.silent()
    s.lost()
    assert s.batch(make_seq(9, 3)) is Action.RESYNC


def test_a_nodes_engine_stream_adds_to_its_daemons_and_resyncs_apart() -> None:
    index = GlobalIndex()
    chain = [1, 2, 3, 4]
    index.apply("a", [BlockStored((1, 2), None, 16, "DISK", namespace_id=3)])
    index.apply("a/gpu", [BlockStored((1, 2, 3), None, 16, "GPU")], namespace_id=3)
    h = index.holdings(3, chain)
    assert h.nodes == ("a",) and h.prefix.tolist() == [3] and h.gpu.tolist() == [3]
    index.clear("a/gpu")
    h = index.holdings(3, chain)
    assert h.prefix.tolist() == [2] and h.ssd.tolist() == [2]
