"""The decode engine's wait rule: wait while a prompt's blocks arrive faster than the engine could
compute them, start on what arrived once they do not, and never past the caps."""

from __future__ import annotations

import pytest

from kvstored_client.vllm.arrival import Arrival, PrefillMeter, Verdict, WaitRule, decide

# blocks of 64 tokens computed at 6,400 tokens/s: 10 ms a block
RULE = WaitRule(prefill_tokens_per_s=6400.0, block_size=64, max_wait_s=2.0)


def started(at_start: int = 0, target: int = 15) -> Arrival:
    return Arrival(started=100.0, at_start=at_start, target=target, observed=100.0, local=at_start)


def test_a_prompt_all_local_starts_at_once() -> None:
    assert decide(RULE, started(at_start=15), now=100.0) is Verdict.ALL_LOCAL
    assert decide(RULE, started(at_start=3, target=3), now=100.0) is Verdict.ALL_LOCAL


def test_until_a_rate_is_seen_it_waits_at_most_as_long_as_computing_the_missing_ones() -> None:
    arrival = started()    # 15 blocks missing: 150 ms to compute
    assert decide(RULE, arrival, now=100.149) is Verdict.WAIT_NO_RATE_YET
    assert decide(RULE, arrival.seen(100.149, 0), now=100.15) is Verdict.NO_ARRIVAL
    first = arrival.seen(100.1, 2)    # the first blocks: no rate from them alone
    assert decide(RULE, first, now=100.1) is Verdict.WAIT_NO_RATE_YET
    assert decide(RULE, first.seen(100.14, 2), now=100.14) is Verdict.NO_ARRIVAL   # 13 missing: 130 ms


def test_blocks_arriving_faster_than_the_engine_computes_them_are_waited_for() -> None:
    # 5 blocks in 10 ms after the first: 500 blocks/s, the engine computes 100/s
    arrival = started().seen(100.01, 1).seen(100.02, 6)
    assert decide(RULE, arrival, now=100.02) is Verdict.WAIT_ARRIVING_FAST
    assert decide(RULE, arrival.seen(100.03, 15), now=100.03) is Verdict.ALL_LOCAL


def test_blocks_arriving_slower_than_the_engine_computes_them_are_not() -> None:
    # 2 blocks in 100 ms after the first: 20 blocks/s against the engine's 100
    arrival = started().seen(100.05, 1).seen(100.15, 3)
    assert decide(RULE, arrival, now=100.15) is Verdict.ARRIVING_SLOWLY
    assert not Verdict.ARRIVING_SLOWLY.waits and Verdict.WAIT_ARRIVING_FAST.waits
    # a prompt partly local at the start: the same
    partly = started(at_start=10).seen(100.05, 11).seen(100.15, 13)
    assert decide(RULE, partly, now=100.15) is Verdict.ARRIVING_SLOWLY


def test_the_time_to_the_first_block_is_not_the_rate() -> None:
    # the link's fixed cost: 3 blocks land together after 60 ms, then 3 more 10 ms later (300/s)
    arrival = started().seen(100.06, 3)
    assert decide(RULE, arrival, now=100.06) is Verdict.WAIT_NO_RATE_YET
    assert decide(RULE, arrival.seen(100.07, 6), now=100.07) is Verdict.WAIT_ARRIVING_FAST


def test_the_hard_cap_ends_any_wait() -> None:
    slow_engine = WaitRule(prefill_tokens_per_s=1.0, block_size=64, max_wait_s=2.0)
    arrival = started().seen(101.8, 10).seen(101.9, 14)
    assert decide(slow_engine, arrival, now=101.9) is Verdict.WAIT_ARRIVING_FAST
    assert decide(slow_engine, arrival, now=102.0) is Verdict.MAX_WAIT


def test_an_observation_never_loses_blocks() -> None:
    assert started().seen(100.1, 5).seen(100.2, 3).local == 5


@pytest.mark.parametrize("rate, block, cap", [(0.0, 64, 1.0), (100.0, 0, 1.0), (100.0, 64, -1.0)])
def test_a_rule_without_sense_is_refused(rate: float, block: int, cap: float) -> None:
    with pytest.raises(ValueError):
        WaitRule(rate, block, cap)


def test_the_prefill_rate_is_the_prior_until_a_step_of_a_block_or_more_is_measured() -> None:
    meter = PrefillMeter(prior=10_000.0, min_tokens=64)
    assert meter.tokens_per_s == 10_000.0
    meter.step_scheduled(1.0, 8)        # decode steps: not prefill
    meter.step_scheduled(1.1, 512)      # ...their time is not counted either
    assert meter.tokens_per_s == 10_000.0
    meter.step_ended(1.6)               # 512 tokens in 0.5 s
    assert meter.tokens_per_s == 1024.0


def test_each_measured_step_moves_the_rate_by_its_weight() -> None:
    meter = PrefillMeter(prior=10_000.0, min_tokens=64, weight=0.25)
    meter.step_scheduled(1.0, 1000)
    meter.step_scheduled(2.0, 2000)     # the first ended when the next was scheduled: 1,000 tokens/s
    meter.step_scheduled(3.0, 0)        # 2,000 tokens/s
    assert meter.tokens_per_s == 1250.0
    meter.step_ended(9.0)               # nothing open: an idle engine measures nothing
    assert meter.tokens_per_s == 1250.0
