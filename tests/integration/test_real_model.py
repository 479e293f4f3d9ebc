"""A real (tiny, random-weight) Llama: KV restored through kvstored gives the same logits as a
fresh prefill, across processes, for fully and partly cached prompts and for multi-turn chats."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the dev extra")

import kvstored
from conftest import ROOT
from tools.tiny_engine import Engine, ModelShape, build_model

warnings.filterwarnings("ignore", category=FutureWarning)

PROCESS_A = """
import sys, numpy as np, kvstored
from tools.tiny_engine import Engine
engine = Engine(kvstored.Client({socket!r}))
turn = engine.run(np.random.default_rng(7).integers(0, 1000, size=100))
print(turn.prefilled_tokens, flush=True)
engine.close()
"""


MODEL = build_model(ModelShape())


@torch.no_grad()
def fresh(prompt: np.ndarray, split: int = 0) -> tuple[torch.Tensor, object]:
    """Logits and KV cache of a fresh prefill without kvstored: in one pass, or (``split``) the
    first ``split`` tokens then the rest, the same chunks a restored run computes."""
    ids = torch.as_tensor(prompt).unsqueeze(0)
    if not split:
        out = MODEL(ids, use_cache=True)
        return out.logits[0, -1], out.past_key_values
    pre = MODEL(ids[:, :split], use_cache=True)
    out = MODEL(ids[:, split:], cache=pre.past_key_values, use_cache=True)
    return out.logits[0, -1], out.past_key_values


def check(engine: Engine, prompt: np.ndarray, turn: object) -> None:
    """Restored KV is the fresh prefill's KV bit for bit; so the logits are those of a fresh run
    with the same chunks bit for bit, and those of a one-pass prefill to float32 rounding (CPU GEMM
    rounds differently for different row counts, with or without kvstored)."""
    cached = turn.cached_tokens  # type: ignore[attr-defined]
    full_logits, full_cache = fresh(prompt)
    blocks = cached // 16
    for layer, view in enumerate(engine.views):
        keys = full_cache.layers[layer].keys[0, :, :cached]  # type: ignore[attr-defined]
        paged = view[0, :blocks].reshape(cached, -1, keys.shape[-1]).permute(1, 0, 2)
        assert torch.equal(paged, keys), f"layer {layer}: restored keys differ from a fresh prefill's"
    split_logits, _ = fresh(prompt, cached)
    assert torch.equal(turn.logits, split_logits)  # type: ignore[attr-defined]
    assert torch.allclose(turn.logits, full_logits, rtol=0, atol=1e-6)  # type: ignore[attr-defined]


def test_restored_kv_gives_identical_logits_across_processes(daemon) -> None:  # type: ignore[no-untyped-def]
    prompt = np.random.default_rng(7).integers(0, 1000, size=100)
    a = subprocess.run([sys.executable, "-c", PROCESS_A.format(socket=daemon.socket)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert a.returncode == 0, a.stderr
    assert a.stdout.split() == ["100"]  # process A prefilled everything and saved 6 blocks
    engine = Engine(kvstored.Client(daemon.socket))  # process B: this one, with its own pages
    try:
        assert engine.client.lookup(prompt, namespace=engine.buffers.namespace).tokens == 96
        restored = engine.run(prompt)
        assert (restored.cached_tokens, restored.prefilled_tokens) == (96, 4)
        check(engine, prompt, restored)

        partly = np.concatenate([prompt[:64], np.random.default_rng(8).integers(0, 1000, size=50)])
        turn = engine.run(partly)
        assert (turn.cached_tokens, turn.prefilled_tokens) == (64, 50)
        check(engine, partly, turn)
    finally:
        engine.close()


def test_multi_turn_prefills_only_new_tokens(daemon) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(11)
    engine = Engine(kvstored.Client(daemon.socket))
    try:
        history = rng.integers(0, 1000, size=70)
        first = engine.run(history)
        assert first.cached_tokens == 0
        for _ in range(3):
            answer_and_question = rng.integers(0, 1000, size=int(rng.integers(20, 40)))
            before = len(history)
            history = np.concatenate([history, answer_and_question])
            turn = engine.run(history)
            assert turn.cached_tokens == (before // 16) * 16  # every whole block of the last turn
            assert turn.prefilled_tokens == len(history) - turn.cached_tokens
            check(engine, history, turn)
    finally:
        engine.close()
