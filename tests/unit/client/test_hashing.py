"""Block hashes: vLLM compatibility (REFERENCE.md vectors), the fast encoder, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstored import block_hashes
from kvstored_client.contract.hashing import none_hash, reference_block_hashes

NONE_HASH = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
H0 = "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c"
H1 = "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac"
H0_EXTRAS = "b9340ae36be5080fe92f5874980290ddc15db5f162931c95fb0e5a994c2ecdf4"


def test_vllm_vectors() -> None:
    assert none_hash("0").hex() == NONE_HASH
    chain = block_hashes(list(range(32)), block_size=16, seed="0")
    assert [h.hex() for h in chain] == [H0, H1]


def test_vllm_vector_with_extras_and_salt_kwargs() -> None:
    assert block_hashes(list(range(16)), extras=[("my-lora", "salt123")])[0].hex() == H0_EXTRAS
    assert block_hashes(list(range(16)), lora_name="my-lora", cache_salt="salt123")[0].hex() == H0_EXTRAS


def test_partial_tail_is_ignored() -> None:
    assert block_hashes(list(range(40))) == block_hashes(list(range(32)))
    assert block_hashes(list(range(15))) == []


def test_seed_salt_and_algo_change_keys() -> None:
    base = block_hashes(list(range(32)))
    assert block_hashes(list(range(32)), seed="1") != base
    salted = block_hashes(list(range(32)), cache_salt="tenant-a")
    assert salted[0] != base[0] and salted[1] != base[1]  # the salt reaches every later block
    fast = block_hashes(list(range(32)), algo="xxh3_128")
    assert len(fast) == 2 and all(len(h) == 16 for h in fast)


def test_an_empty_salt_is_no_salt_as_in_vllm() -> None:
    """(review) vLLM adds a request's cache_salt to block 0's extra keys only when it is
    non-empty; block_hashes(cache_salt="") added "" and so keyed every block apart from the
    engine's own hashes (and from the daemon's, which already took "" as no salt)."""
    tokens = list(range(32))
    assert block_hashes(tokens, cache_salt="") == block_hashes(tokens)
    assert block_hashes(tokens, cache_salt="", lora_name="l") == block_hashes(tokens, lora_name="l")


def test_prefix_property() -> None:
    a = block_hashes(list(range(64)))
    b = block_hashes([*range(48), *range(100, 116)])
    assert a[:3] == b[:3] and a[3] != b[3]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=120),
       block_size=st.integers(min_value=1, max_value=20),
       algo=st.sampled_from(["sha256_cbor", "xxh3_128"]))
def test_fast_encoder_matches_cbor2(tokens: list[int], block_size: int, algo: str) -> None:
    assert block_hashes(tokens, block_size, algo=algo) == reference_block_hashes(tokens, block_size, algo=algo)


def test_fast_encoder_matches_cbor2_at_every_width_boundary() -> None:
    edges = [0, 1, 23, 24, 25, 255, 256, 257, 65535, 65536, 65537, 2**32 - 2, 2**32 - 1]
    tokens = [t for e in edges for t in (e, edges[-1 - edges.index(e)])] * 3
    for block_size in (1, 5, 16):
        assert block_hashes(tokens, block_size) == reference_block_hashes(tokens, block_size)


def test_numpy_and_list_inputs_agree() -> None:
    toks = np.random.default_rng(0).integers(0, 150_000, size=300)
    assert block_hashes(toks) == block_hashes(toks.tolist()) == block_hashes(toks.astype(np.uint32))


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, [[1, 2]] * 16])
def test_bad_tokens_raise(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        block_hashes(bad)


def test_bad_algo_and_block_size() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        block_hashes(list(range(16)), algo="md5")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(list(range(16)), block_size=0)


def test_memo_gives_identical_chains() -> None:
    from kvstored_client.contract.hashing import MEMO_GROUP, ChainHasher

    hasher = ChainHasher(memo_blocks=4 * MEMO_GROUP)
    rng = np.random.default_rng(5)
    system = rng.integers(0, 150_000, size=16 * (2 * MEMO_GROUP + 3))
    for _ in range(20):  # shared prefixes, new suffixes, a memo that fills and clears
        toks = np.concatenate([system, rng.integers(0, 150_000, size=int(rng.integers(0, 16 * 2 * MEMO_GROUP)))])
        assert hasher.hashes(toks) == block_hashes(toks)
        assert hasher.hashes(toks, cache_salt="t") == block_hashes(toks, cache_salt="t")


def test_memo_tells_apart_blocks_that_differ_only_in_their_extras() -> None:
    """The memo holds groups of blocks: a group seen before with other extras (a multimodal
    input's hash, a LoRA) or under another salt must not be answered from it."""
    from kvstored_client.contract.hashing import MEMO_GROUP, ChainHasher

    hasher = ChainHasher(memo_blocks=1 << 10)
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 150_000, size=16 * (2 * MEMO_GROUP + 3))
    n = len(toks) // 16
    plain: list[tuple[object, ...] | None] = [None] * n
    image = list(plain)
    image[MEMO_GROUP + 1] = ("img-1",)
    other = list(plain)
    other[MEMO_GROUP + 1] = ("img-2",)
    for _ in range(2):   # the second round answered from the memo
        for extras in (plain, image, other):
            for lora in (None, "adapter"):
                got = hasher.hashes(toks, extras, lora_name=lora)
                assert got == block_hashes(toks, extras=extras, lora_name=lora)
    assert hasher.hashes(toks, image)[:MEMO_GROUP + 1] == hasher.hashes(toks, other)[:MEMO_GROUP + 1]
    assert hasher.hashes(toks, image)[MEMO_GROUP + 1] != hasher.hashes(toks, other)[MEMO_GROUP + 1]
