"""A minimal inference engine around a Hugging Face Llama whose KV cache lives in paged buffers
registered with kvstored (vLLM's per-layer layout ``(2, num_blocks, block_size, kv_heads, head_dim)``).

It is what the real-model tests and the TTFT benchmark drive: prefill a prompt (reusing whatever
prefix kvstored has), save the new whole blocks, and return the next-token logits. Weights are random
from a fixed seed, so every process that builds the same config gets the same model; nothing is
downloaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

import kvstored

BLOCK = 16


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 1000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def build_model(shape: ModelShape, seed: int = 0, max_positions: int = 16384) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                      max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).eval()


@dataclass
class Turn:
    cached_tokens: int       # reused from kvstored
    prefilled_tokens: int    # computed by the model
    logits: torch.Tensor     # next-token logits after the prompt
    ttft_s: float = 0.0      # from the call to the logits (the load and the prefill; not the save after)


class Engine:
    """One engine process: a model, paged KV buffers in shared memory, a kvstored client."""

    def __init__(self, client: kvstored.Client, shape: ModelShape = ModelShape(), num_blocks: int = 64,
                 seed: int = 0) -> None:
        self.shape = shape
        self.model = build_model(shape, seed)
        self.client = client
        self.pages = [kvstored.shm.empty((2, num_blocks, BLOCK, shape.kv_heads, shape.head_dim), "float32")
                      for _ in range(shape.layers)]
        self.views = [p.torch() for p in self.pages]
        ns = kvstored.Namespace(model=f"tiny-llama-{shape.hidden}x{shape.layers}-seed{seed}", kv_dtype="float32",
                                block_size=BLOCK)
        self.buffers = client.register_buffers(self.views, block_dim=1, namespace=ns)
        self.num_blocks = num_blocks

    def _cache_from_pages(self, blocks: int) -> DynamicCache:
        cache = DynamicCache()
        n = blocks * BLOCK
        for layer, view in enumerate(self.views):
            # (2, blocks, block, heads, dim) -> (1, heads, tokens, dim) for K and V
            kv = view[:, :blocks].reshape(2, n, self.shape.kv_heads, self.shape.head_dim).permute(0, 2, 1, 3)
            cache.update(kv[0].unsqueeze(0).contiguous(), kv[1].unsqueeze(0).contiguous(), layer)
        return cache

    def _pages_from_cache(self, cache: DynamicCache, first_block: int, blocks: int) -> None:
        for layer, view in enumerate(self.views):
            keys, values = cache.layers[layer].keys, cache.layers[layer].values  # (1, heads, tokens, dim)
            for which, t in ((0, keys), (1, values)):
                part = t[0, :, first_block * BLOCK:(first_block + blocks) * BLOCK]  # (heads, tokens, dim)
                view[which, first_block:first_block + blocks] = part.permute(1, 0, 2).reshape(
                    blocks, BLOCK, self.shape.kv_heads, self.shape.head_dim)

    @torch.no_grad()
    def run(self, prompt: np.ndarray, use_store: bool = True) -> Turn:
        """Prefill ``prompt`` (pages 0.. hold its blocks in order), reuse and save through kvstored."""
        start = time.perf_counter()
        ids = torch.as_tensor(np.asarray(prompt), dtype=torch.long).unsqueeze(0)
        whole = len(prompt) // BLOCK
        assert whole <= self.num_blocks, "prompt longer than the engine's pages"
        cached = 0
        if use_store:
            cached = self.client.load_blocks(self.buffers, list(range(whole)), prompt).blocks
        if cached * BLOCK == len(prompt):
            cached -= 1  # recompute the last block to get logits for the last token
        cache = self._cache_from_pages(cached) if cached else DynamicCache()
        out = self.model(ids[:, cached * BLOCK:], cache=cache, use_cache=True)
        ttft = time.perf_counter() - start
        if use_store and whole > cached:
            self._pages_from_cache(out.past_key_values, cached, whole - cached)
            self.client.save_blocks(self.buffers, list(range(whole)), prompt)
        return Turn(cached * BLOCK, len(prompt) - cached * BLOCK, out.logits[0, -1].clone(), ttft)

    def close(self) -> None:
        self.client.unregister_buffers(self.buffers)
        for p in self.pages:
            p.close()
