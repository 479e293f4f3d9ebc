"""The TTFT ledger, the pull option, the spreading of near-equal choices, the prefill fit, and the
router over them (its errors included)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvstored.events.wire import BlockStored
from kvstored.policy.cost import ModelShape, prefix_prefill_flops
from kvstored.policy.prefill_fit import PrefillFit
from kvstored.policy.routing import Breakdown, Held, NodeCosts, Request, choose, estimate, estimate_all
from kvstored.router.calibration import Calibration
from kvstored.router.index import GlobalIndex
from kvstored.router.load import LoadBoard
from kvstored.router.reports import NodeReports
from kvstored.router.router import RouteError, RouteQuery, Router
from kvstored_client.contract.namespace import Namespace

SHAPE = ModelShape.llama3_8b()
REQ = Request(tokens=16 * 512, block_tokens=512, block_bytes=64 << 20)


def costs(queue_s: float = 0.0) -> NodeCosts:
    return NodeCosts(queue_s=queue_s, prefill_flops_per_s=3e14, decode_s=0.02)


def test_the_ledger_adds_queue_the_slower_of_prefill_and_fetch_and_decode() -> None:
    b = estimate("a", Held(8, dram=8), REQ, SHAPE, costs(0.5))
    flops = prefix_prefill_flops(SHAPE, 16 * 512, 1) - prefix_prefill_flops(SHAPE, 8 * 512, 1)
    assert b.prefill_s == pytest.approx(flops / 3e14)
    assert b.fetch_s == pytest.approx(8 * (64 << 20) / 19e9)
    assert b.ttft_s == pytest.approx(0.5 + max(b.prefill_s, b.fetch_s) + 0.02)
    assert (b.local_blocks, b.pulled_blocks, b.pull_from) == (8, 0, "")
    # everything cached: only the last token is computed again
    full = estimate("a", Held(16, gpu=16), REQ, SHAPE, costs())
    assert full.fetch_s == 0 and full.prefill_s < b.prefill_s / 100


def test_pulling_a_longer_prefix_from_a_peer_is_a_costed_option() -> None:
    donor = ("b", Held(16, dram=16), costs(5.0))
    pulled = estimate("a", Held(0), REQ, SHAPE, costs(), donor)
    assert (pulled.pull_from, pulled.pulled_blocks, pulled.cached_blocks) == ("b", 16, 16)
    slow_link = NodeCosts(queue_s=0.0, prefill_flops_per_s=3e14, decode_s=0.02, peer_bytes_per_s=1e6)
    assert estimate("a", Held(0), REQ, SHAPE, slow_link, donor).pull_from == ""
    both = {b.node: b for b in estimate_all(REQ, SHAPE, {"b": Held(16, dram=16)}, {"a": costs(), "b": costs(5.0)})}
    assert both["a"].pull_from == "b" and both["a"].ttft_s < both["b"].ttft_s


def test_near_equal_choices_are_spread_and_a_clear_winner_is_not() -> None:
    rng = random.Random(1)
    same = [Breakdown(n, 1.0, 0.0, 1.0, 0.0, 0.0, 0, 0) for n in "abcd"]
    picks = Counter(choose(same, rng).node for _ in range(400))
    assert set(picks) == set("abcd") and min(picks.values()) > 50
    clear = [*same[:3], Breakdown("z", 0.5, 0.0, 0.5, 0.0, 0.0, 0, 0)]
    assert {choose(clear, rng).node for _ in range(50)} == {"z"}
    with pytest.raises(ValueError):
        choose([], rng)


def test_the_prefill_fit_finds_rate_and_overhead() -> None:
    fit = PrefillFit(prior_flops_per_s=4e14)
    assert fit.speed().flops_per_s == 4e14 and fit.speed().samples == 0
    for flops in (1e13, 5e13, 1e14, 3e14) * 5:
        fit.observe(flops, 0.01 + flops / 2e14)
    speed = fit.speed()
    assert speed.flops_per_s == pytest.approx(2e14, rel=1e-6) and speed.overhead_s == pytest.approx(0.01, abs=1e-9)


def _router(nodes: list[str]) -> tuple[Router, GlobalIndex]:
    index = GlobalIndex()
    clock = [0.0]
    return Router(index, LoadBoard(lambda: clock[0]), Calibration(4e14), NodeReports(), lambda: nodes,
                  random.Random(0)), index


def test_the_router_routes_to_the_holder_and_says_why_not_when_it_cannot() -> None:
    router, index = _router(["a", "b"])
    ns = Namespace(model="m", block_size=16)
    tokens = list(range(16 * 64))
    keys = [int.from_bytes(h[-8:], "big") for h in __import__("kvstored").block_hashes(tokens)]
    index.apply("a", [BlockStored(tuple(keys), None, 16, "CPU", namespace_id=ns.identity())])
    answer = router.route(RouteQuery(ns, token_ids=tokens))
    assert {c.node: c.local_blocks for c in answer.candidates} == {"a": 64, "b": 0}
    assert router.route(RouteQuery(ns, block_hashes=(), tokens=10)).blocks == 0   # shorter than a block
    for bad in (RouteQuery(ns), RouteQuery(ns, token_ids=[1], block_hashes=[1]),
                RouteQuery(Namespace(model=""), token_ids=[1]), RouteQuery(ns, block_hashes=[1.5]),  # type: ignore[list-item]
                RouteQuery(ns, block_hashes=[1, 2], tokens=3)):
        with pytest.raises(RouteError) as err:
            router.route(bad)
        assert err.value.reason == "invalid_argument"
    with pytest.raises(RouteError) as err:
        router.route(RouteQuery(ns, token_ids=tokens, candidates=["zz"]))
    assert err.value.reason == "no_candidate"
    empty, _ = _router([])
    with pytest.raises(RouteError) as err:
        empty.route(RouteQuery(ns, token_ids=tokens))
    assert err.value.reason == "no_candidate"


def test_a_chain_just_sent_counts_as_held_there_until_the_events_say_so() -> None:
    router, _ = _router(["a", "b"])
    ns = Namespace(model="m", block_size=16)
    tokens = list(range(16 * 32))
    first = router.route(RouteQuery(ns, token_ids=tokens))
    assert {c.local_blocks for c in first.candidates} == {0}
    second = router.route(RouteQuery(ns, token_ids=tokens), record=False)
    assert {c.node: c.local_blocks for c in second.candidates} == {first.node: 32, ({"a", "b"} - {first.node}).pop(): 0}
