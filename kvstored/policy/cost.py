"""The cost model: what a block costs to recompute, to move between tiers, and what TTFT will be.

One model prices every decision (DESIGN.md, "Cost model"): admission to a slower tier, the value
of a cache hit in the trace replay, and routing by estimated TTFT. Everything here is a pure
function of its arguments; measured figures (bandwidths, prefill speed) come in as values, so
callers decide whether they are configured or measured.

Prefill FLOPs of one block of ``B`` tokens at block index ``p`` (tokens ``p*B .. p*B+B-1``):

    2 * params * B                          (the dense layers: 2 FLOPs per weight per token)
  + 4 * layers * d_model * B * (p*B + B/2)  (attention scores and weighted sum over the prefix)

so a block deep in a long prompt costs more to recompute than the first one. Units: FLOPs,
bytes, seconds, bytes per second and FLOPs per second throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstored_client.contract.namespace import Namespace


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The few numbers of a transformer that its prefill cost and KV size depend on."""

    params: float        # parameters touched per token (weights of the dense layers)
    layers: int
    d_model: int
    kv_heads: int = 8    # key/value heads (grouped-query attention)
    head_dim: int = 128

    @classmethod
    def llama3_8b(cls) -> ModelShape:
        """Llama-3-8B: 32 layers, d_model 4096, 8 KV heads of 128, about 8.0e9 parameters."""
        return cls(params=8.0e9, layers=32, d_model=4096, kv_heads=8, head_dim=128)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V of one token over all layers (before tensor-parallel sharding)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def prefill_flops(shape: ModelShape, block_index: int, block_tokens: int, tokens: int | None = None) -> float:
    """FLOPs to prefill block ``block_index`` of a prompt cut into blocks of ``block_tokens``.

    ``tokens`` (default: a full block) is how many tokens the block holds; a partial last block
    costs its dense share and attention over the prefix in front of it. Raises ValueError on a
    negative index or token count.
    """
    n = block_tokens if tokens is None else tokens
    if block_index < 0 or block_tokens <= 0 or not 0 <= n <= block_tokens:
        raise ValueError(f"bad block: index {block_index}, {n} of {block_tokens} tokens")
    start = block_index * block_tokens
    return 2.0 * shape.params * n + 4.0 * shape.layers * shape.d_model * n * (start + n / 2.0)


def prefix_prefill_flops(shape: ModelShape, blocks: int, block_tokens: int) -> float:
    """FLOPs to prefill the first ``blocks`` full blocks: the sum of :func:`prefill_flops` over
    indices ``0 .. blocks-1``, in closed form (``2·P·B·n + 2·L·d·B²·n²``)."""
    if blocks < 0 or block_tokens <= 0:
        raise ValueError(f"bad prefix: {blocks} blocks of {block_tokens} tokens")
    b = float(block_tokens)
    return 2.0 * shape.params * b * blocks + 2.0 * shape.layers * shape.d_model * b * b * blocks * blocks


def flops_seconds(flops: float, flops_per_s: float) -> float:
    """Time to compute ``flops`` at a prefill speed of ``flops_per_s`` (configured or measured)."""
    if flops_per_s <= 0:
        raise ValueError("flops_per_s must be positive")
    return flops / flops_per_s


@dataclass(frozen=True, slots=True)
class TierCosts:
    """Read and write speed of one tier, for blocks of a given size: ``latency + bytes / bandwidth``."""

    name: str
    read_bytes_per_s: float
    write_bytes_per_s: float
    read_latency_s: float = 0.0
    write_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.read_bytes_per_s <= 0 or self.write_bytes_per_s <= 0:
            raise ValueError(f"tier {self.name!r}: bandwidths must be positive")

    def read_seconds(self, nbytes: int) -> float:
        return self.read_latency_s + nbytes / self.read_bytes_per_s

    def write_seconds(self, nbytes: int) -> float:
        return self.write_latency_s + nbytes / self.write_bytes_per_s


# The reference machine's tiers (REFERENCE.md): realistic memcpy into pinned DRAM, 19 GB/s both
# ways; LMDB on its SSD, random reads ~1.85 GB/s and synced puts ~1.1 GB/s.
DRAM_REFERENCE = TierCosts("dram", 19e9, 19e9)
SSD_REFERENCE = TierCosts("ssd", 1.85e9, 1.1e9)


def admit(prefill_s: float, block_bytes: int, slow: TierCosts, fast: TierCosts) -> bool:
    """The tiering inequality: keeping a block in ``slow`` pays when recomputing it costs more than
    reading it back from ``slow`` and writing it into ``fast``:
    ``prefill_cost(block) > read_cost(slow) + write_cost(fast)``."""
    return prefill_s > slow.read_seconds(block_bytes) + fast.write_seconds(block_bytes)


def break_even(shape: ModelShape, block_tokens: int, block_bytes: int, flops_per_s: float, slow: TierCosts,
               fast: TierCosts = DRAM_REFERENCE, limit: int = 1 << 20) -> int | None:
    """The first block index from which keeping blocks in ``slow`` pays (:func:`admit`): a
    block's prefill grows with its depth (attention over the prefix), reading it back does not.
    None when no block before ``limit`` pays."""
    def pays(index: int) -> bool:
        return admit(prefill_flops(shape, index, block_tokens) / flops_per_s, block_bytes, slow, fast)

    if not pays(limit):
        return None
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if pays(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def ttft_estimate(queue_s: float, missed_prefill_s: float, kv_wait_s: float,
                  first_block_decode_s: float) -> float:
    """Estimated time to first token on one instance:
    ``queue + max(prefill of the missed suffix, wait for the hit KV to arrive) + first-block decode``.

    Loading the hit prefix overlaps computing the missed suffix, hence the max.
    """
    if min(queue_s, missed_prefill_s, kv_wait_s, first_block_decode_s) < 0:
        raise ValueError("TTFT terms must not be negative")
    return queue_s + max(missed_prefill_s, kv_wait_s) + first_block_decode_s


# Prefill speed assumed when none is configured or measured: an H100-class GPU at about 40% of
# its dense BF16 peak. A slower accelerator makes recomputation dearer and slower tiers pay sooner.
DEFAULT_PREFILL_FLOPS_PER_S = 4.0e14

_PRESETS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape.llama3_8b(),
    "llama-3.1-8b": ModelShape.llama3_8b(),
    "llama3-8b": ModelShape.llama3_8b(),
}


def shape_for(model: str) -> ModelShape:
    """The shape of a known model, matched on the last path part of its id, lower case
    (``meta-llama/Meta-Llama-3-8B-Instruct`` → Llama-3-8B); unknown models get the Llama-3-8B
    shape, a middle-sized default."""
    name = model.rsplit("/", 1)[-1].lower().removeprefix("meta-")
    for prefix, shape in _PRESETS.items():
        if name.startswith(prefix):
            return shape
    return ModelShape.llama3_8b()


@dataclass(frozen=True, slots=True)
class CostModel:
    """Calibration for :func:`admit_block`: the prefill speed and the two tiers' costs."""

    prefill_flops_per_s: float = DEFAULT_PREFILL_FLOPS_PER_S
    fast: TierCosts = DRAM_REFERENCE
    slow: TierCosts = SSD_REFERENCE


def admit_block(spec: Namespace, depth: int, model: CostModel | None = None) -> bool:
    """Should a block at index ``depth`` of namespace ``spec`` be kept in the slow tier?

    Prices one tensor-parallel shard: its share of the prefill FLOPs at ``model``'s prefill speed
    against reading its ``spec.block_bytes`` (estimated from the model shape in 16-bit KV when
    not fixed yet) from the slow tier and writing them into the fast one.
    """
    m = model or CostModel()
    shape = shape_for(spec.model)
    shards = max(spec.tp_size, 1)
    nbytes = spec.block_bytes or shape.kv_bytes_per_token() * spec.block_size // shards
    seconds = flops_seconds(prefill_flops(shape, depth, spec.block_size) / shards, m.prefill_flops_per_s)
    return admit(seconds, nbytes, m.slow, m.fast)
