"""The model shapes ``python -m tools.bench vllm --shape`` serves: random-weight Llamas whose
dimensions, not their weights, decide what a prefill costs and how many KV bytes a token takes.

``tiny`` (the default; ``--hidden``/``--layers`` resize it) is the shape BENCHMARKS §11 measured
first; ``llama-3.2-1b`` is Llama-3.2-1B's shape (its config.json: 16 layers, hidden 2048, 32 heads,
8 KV heads of 64, MLP 8192, vocab 128,256, tied embeddings, llama3 rope).
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """One model's dimensions, the dtype it is served in by default, and whether its rope is
    Llama-3.2's (theta 500,000, llama3 scaling)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    llama3_rope: bool
    dtype: str
    init_range: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def cache_name(self, dtype: str) -> str:
        """A directory name that changes with anything that changes the generated weights."""
        return (f"{self.name}-h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}-i{self.intermediate}"
                f"-v{self.vocab}{'-tied' if self.tied else ''}{'-rope3' if self.llama3_rope else ''}"
                f"-r{self.init_range:g}-{dtype}")

    def engine_args(self, dtype: str) -> list[str]:
        """The options of ``vllm_engine.py make-model`` that generate this shape."""
        return (["--hidden", str(self.hidden), "--layers", str(self.layers), "--heads", str(self.heads),
                 "--kv-heads", str(self.kv_heads), "--intermediate", str(self.intermediate), "--vocab",
                 str(self.vocab), "--init-range", f"{self.init_range:g}", "--dtype", dtype]
                + (["--tie"] if self.tied else []) + (["--llama3-rope"] if self.llama3_rope else []))

    def describe(self, dtype: str) -> str:
        return (f"{self.name}: hidden {self.hidden}, {self.layers} layers, {self.heads} heads, {self.kv_heads} KV "
                f"heads of {self.head_dim}, MLP {self.intermediate}, vocab {self.vocab}, {dtype}, "
                f"{self.kv_bytes_per_token(dtype) // 1024} KiB of KV per token")


def tiny(hidden: int = 512, layers: int = 4) -> ModelShape:
    """The first shape measured: heads of 64, 2 KV heads, MLP twice the hidden size, fp32."""
    return ModelShape("tiny", hidden, layers, hidden // 64, 2, hidden * 2, 1024, False, False, "float32", 0.3)


# bf16 by default: vLLM's CPU build runs it on AVX-512 BF16 (BENCHMARKS §11b says how fast), and
# the weights take 2.5 GB instead of 5 on a machine whose memory other jobs share
LLAMA_3_2_1B = ModelShape("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, True, True, "bfloat16", 0.02)

SHAPES = ("tiny", LLAMA_3_2_1B.name)


def shape(name: str, hidden: int | None = None, layers: int | None = None) -> ModelShape:
    """The shape called ``name``; ``hidden``/``layers`` resize ``tiny`` only (ValueError otherwise)."""
    if name == "tiny":
        return tiny(hidden or 512, layers or 4)
    if name == LLAMA_3_2_1B.name:
        if hidden is not None or layers is not None:
            raise ValueError(f"--hidden and --layers resize the tiny shape only, not {name}")
        return LLAMA_3_2_1B
    raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
