"""SGLang pages as kvstored blocks: keys, chains and namespaces."""

from __future__ import annotations

from kvstored_client.sglang.pages import HASH_SEED, PageChain, PoolShape, block_key


def shape(**changes: object) -> PoolShape:
    base = dict(model="m", kv_dtype="bfloat16", page_size=64, layout="page_first", tp_rank=1, tp_size=4,
                pp_rank=0, pp_size=1, replicated=False)
    base.update(changes)
    return PoolShape(**base)  # type: ignore[arg-type]


def test_a_chain_runs_from_the_sequence_start_and_counts_only_the_calls_own_pages() -> None:
    chain = PageChain.of(["c", "d", "e"], ["a", "b"])
    assert chain.hashes == tuple(block_key(k) for k in "abcde") and chain.start == 2
    assert [chain.own(n) for n in (0, 2, 3, 5, 9)] == [0, 0, 1, 3, 3]
    assert len(block_key("x")) == 32 and block_key("x") != block_key("y")


def test_pools_whose_pages_differ_in_bytes_never_share_a_namespace() -> None:
    base = shape().namespace()
    assert base.hash_seed == HASH_SEED and base.block_size == 64
    others = [shape(layout="layer_first"), shape(kv_dtype="float16"), shape(tp_rank=2), shape(pp_rank=1, pp_size=2),
              shape(page_size=32), shape(model="n")]
    assert len({base.identity(), *(s.namespace().identity() for s in others)}) == 1 + len(others)


def test_mla_ranks_share_one_namespace() -> None:
    assert shape(replicated=True, tp_rank=0).namespace() == shape(replicated=True, tp_rank=3).namespace()
