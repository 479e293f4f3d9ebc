"""The cost model: prefill FLOPs by position, tier costs, the admission inequality, TTFT."""

from __future__ import annotations

import pytest

from kvstored.policy.cost import (
    DRAM_REFERENCE,
    SSD_REFERENCE,
    CostModel,
    ModelShape,
    TierCosts,
    admit,
    admit_block,
    break_even,
    flops_seconds,
    prefill_flops,
    prefix_prefill_flops,
    shape_for,
    ttft_estimate,
)
from kvstored_client.contract.namespace import Namespace

LLAMA = ModelShape.llama3_8b()


def test_llama3_8b_preset() -> None:
    assert (LLAMA.params, LLAMA.layers, LLAMA.d_model) == (8.0e9, 32, 4096)
    assert LLAMA.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB of bf16 K and V per token


def test_prefill_flops_matches_the_formula() -> None:
    b = 512
    for p in (0, 1, 7, 100):
        expected = 2 * 8.0e9 * b + 4 * 32 * 4096 * b * (p * b + b / 2)
        assert prefill_flops(LLAMA, p, b) == pytest.approx(expected)
    # the first block is mostly the dense layers; block 60 of 512 tokens costs about twice as much
    assert prefill_flops(LLAMA, 0, b) == pytest.approx(8.26e12, rel=1e-2)
    assert 1.9 < prefill_flops(LLAMA, 60, b) / prefill_flops(LLAMA, 0, b) < 2.1


def test_deeper_blocks_cost_more() -> None:
    costs = [prefill_flops(LLAMA, p, 16) for p in range(50)]
    assert costs == sorted(costs) and len(set(costs)) == 50


def test_partial_block_costs_less_than_a_full_one() -> None:
    full = prefill_flops(LLAMA, 3, 512)
    half = prefill_flops(LLAMA, 3, 512, tokens=256)
    assert 0 < half < full
    assert prefill_flops(LLAMA, 3, 512, tokens=512) == full
    assert prefill_flops(LLAMA, 3, 512, tokens=0) == 0


def test_prefix_sum_closed_form() -> None:
    for n in (0, 1, 2, 13, 247):
        assert prefix_prefill_flops(LLAMA, n, 512) == pytest.approx(
            sum(prefill_flops(LLAMA, p, 512) for p in range(n)))


@pytest.mark.parametrize("args", [(-1, 16), (0, 0), (0, 16, 17), (0, 16, -1)])
def test_bad_blocks_are_refused(args: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        prefill_flops(LLAMA, *args)


def test_flops_to_seconds() -> None:
    assert flops_seconds(4e14, 4e14) == 1.0
    with pytest.raises(ValueError):
        flops_seconds(1.0, 0.0)


def test_tier_costs() -> None:
    t = TierCosts("x", read_bytes_per_s=1e9, write_bytes_per_s=5e8, read_latency_s=1e-4)
    assert t.read_seconds(10**9) == pytest.approx(1.0001)
    assert t.write_seconds(10**9) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        TierCosts("bad", 0.0, 1.0)


def test_admission_inequality() -> None:
    slow = TierCosts("ssd", 1e9, 1e9)
    fast = TierCosts("dram", 1e10, 1e10)
    nbytes = 10**6  # 1 ms read from slow + 0.1 ms write to fast
    assert admit(0.0012, nbytes, slow, fast)
    assert not admit(0.0010, nbytes, slow, fast)
    assert not admit(0.0011, nbytes, slow, fast)  # equal cost: recomputing is as good, keep nothing


def test_admit_block_prices_depth() -> None:
    spec = Namespace(model="meta-llama/Meta-Llama-3-8B-Instruct", block_size=16)
    # With an H100-class prefill, a shallow 16-token block is cheaper to recompute than to read
    # 2 MiB back from SSD; deep in a long prompt attention makes it dearer.
    assert not admit_block(spec, 0)
    assert admit_block(spec, 4000)
    slow_gpu = CostModel(prefill_flops_per_s=1e13, fast=DRAM_REFERENCE, slow=SSD_REFERENCE)
    assert admit_block(spec, 0, slow_gpu)
    # monotone in depth
    decisions = [admit_block(spec, d) for d in range(0, 4000, 100)]
    assert decisions == sorted(decisions)


def test_shape_for_known_and_unknown_models() -> None:
    assert shape_for("meta-llama/Meta-Llama-3-8B") == LLAMA
    assert shape_for("llama-3.1-8b-instruct") == LLAMA
    assert shape_for("something-else") == LLAMA


def test_ttft_estimate_overlaps_load_and_prefill() -> None:
    assert ttft_estimate(0.01, 0.2, 0.05, 0.02) == pytest.approx(0.23)
    assert ttft_estimate(0.01, 0.05, 0.2, 0.02) == pytest.approx(0.23)
    assert ttft_estimate(0, 0, 0, 0) == 0
    with pytest.raises(ValueError):
        ttft_estimate(-1, 0, 0, 0)


def test_break_even_is_the_first_block_whose_prefill_outweighs_the_read() -> None:
    """An 8B model at 4e14 FLOP/s with 2 MiB blocks: DRAM pays from the first block, the reference
    SSD only deep into a prompt (attention makes deeper blocks dearer), a slow enough tier never."""
    shape, nbytes, rate = ModelShape.llama3_8b(), 2 << 20, 4e14
    assert break_even(shape, 16, nbytes, rate, DRAM_REFERENCE) == 0
    ssd = break_even(shape, 16, nbytes, rate, SSD_REFERENCE)
    assert ssd is not None and ssd > 0
    assert admit(prefill_flops(shape, ssd, 16) / rate, nbytes, SSD_REFERENCE, DRAM_REFERENCE)
    assert not admit(prefill_flops(shape, ssd - 1, 16) / rate, nbytes, SSD_REFERENCE, DRAM_REFERENCE)
    assert break_even(shape, 16, nbytes, rate, TierCosts("tape", 1e3, 1e3), limit=1 << 10) is None
