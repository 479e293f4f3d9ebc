"""``python -m tools.bench vllm``'s pure parts: the model shapes it generates (Llama-3.2-1B's is
the published one) and the table of medians it prints. vLLM itself is not run here (the
benchmark's end-to-end run is a benchmark, and ``tests/integration/test_vllm.py`` runs vLLM)."""

from __future__ import annotations

import pytest

from tools.bench.vllm_shapes import LLAMA_3_2_1B, SHAPES, shape
from tools.bench.vllm_ttft import table


def test_the_1b_shape_is_llama_3_2_1b() -> None:
    model = shape("llama-3.2-1b")
    assert (model.hidden, model.layers, model.heads, model.kv_heads, model.head_dim) == (2048, 16, 32, 8, 64)
    assert (model.intermediate, model.vocab, model.tied, model.llama3_rope) == (8192, 128256, True, True)
    # 16 layers x (K, V) x 8 heads x 64: 32 KiB a token in bf16, a 64-token block 2 MiB
    assert model.kv_bytes_per_token("bfloat16") == 32 * 1024
    assert model.kv_bytes_per_token("float32") == 64 * 1024
    assert model.dtype == "bfloat16"


def test_the_default_shape_is_the_tiny_model_first_measured() -> None:
    model = shape("tiny")
    assert (model.hidden, model.layers, model.heads, model.kv_heads, model.intermediate) == (512, 4, 8, 2, 1024)
    assert model.dtype == "float32"
    assert model.kv_bytes_per_token("float32") == 4 * 1024   # BENCHMARKS §11: 256 KiB blocks of 64 tokens
    assert shape("tiny", hidden=1024, layers=2).heads == 16


def test_only_the_tiny_shape_takes_a_size_and_unknown_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="tiny shape only"):
        shape("llama-3.2-1b", hidden=1024)
    with pytest.raises(ValueError, match="unknown shape"):
        shape("llama-70b")
    assert SHAPES == ("tiny", "llama-3.2-1b")


def test_the_generated_model_is_cached_under_a_name_that_changes_with_its_weights() -> None:
    names = {shape("tiny").cache_name("float32"), shape("tiny", layers=2).cache_name("float32"),
             LLAMA_3_2_1B.cache_name("bfloat16"), LLAMA_3_2_1B.cache_name("float32")}
    assert len(names) == 4
    args = LLAMA_3_2_1B.engine_args("bfloat16")
    assert args[args.index("--vocab") + 1] == "128256" and "--tie" in args and "--llama3-rope" in args
    assert "--tie" not in shape("tiny").engine_args("float32")


def test_the_table_gives_medians_and_their_ratios_to_the_cold_prefill() -> None:
    times = {(2048, "cold"): [1.0, 3.0, 2.0], (2048, "dram"): [0.1, 0.2, 0.3], (2048, "ssd"): [0.3, 0.4, 0.5],
             (2048, "peer"): [0.5, 0.2, 0.3], (2048, "vllm"): [0.05, 0.05, 0.05]}
    cached = {(2048, "dram"): 1984}
    lines = table(times, cached, [2048], lmcache=False)
    assert lines[0] == ("| prompt tokens | cold prefill | kvstored DRAM | kvstored SSD | kvstored peer | "
                        "vLLM's own cache | tokens restored (DRAM) |")
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2] == "| 2048 | 2000 | 200 (0.100x) | 400 (0.200x) | 300 (0.150x) | 50 (0.025x) | 1984 |"


def test_the_table_has_lmcaches_columns_when_it_ran() -> None:
    times = {(8192, "cold"): [2.0], (8192, "dram"): [0.1], (8192, "ssd"): [0.2], (8192, "peer"): [0.3],
             (8192, "vllm"): [0.05], (8192, "lmcache"): [0.4], (8192, "lmcache-cold"): [2.2]}
    cached = {(8192, "dram"): 8128, (8192, "lmcache"): 8191}
    head, _, row = table(times, cached, [8192], lmcache=True)
    assert head.endswith("| LMCache connector (DRAM) | cold with LMCache's connector | tokens restored (DRAM) | "
                         "tokens restored (LMCache) |")
    assert row == "| 8192 | 2000 | 100 (0.050x) | 200 (0.100x) | 300 (0.150x) | 50 (0.025x) | 400 (0.200x) | " \
                  "2200 (1.100x) | 8128 | 8191 |"
