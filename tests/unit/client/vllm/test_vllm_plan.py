"""What the vLLM connector's scheduler side asks its worker side to load and store."""

from __future__ import annotations

from kvstored_client.vllm.plan import SavePlanner, blocks_spanned, external_tokens, loadable_blocks

H = [bytes([i]) * 32 for i in range(40)]


def test_every_whole_block_is_loadable_but_the_last_token_is_left_to_compute() -> None:
    assert loadable_blocks(hit_blocks=4, num_tokens=64, block_size=16) == 4   # all cached: the last block too
    assert external_tokens(hit_blocks=4, num_tokens=64, num_computed=0, block_size=16) == 63   # ... short of a token
    assert loadable_blocks(hit_blocks=4, num_tokens=65, block_size=16) == 4
    assert external_tokens(hit_blocks=4, num_tokens=65, num_computed=0, block_size=16) == 64
    assert loadable_blocks(hit_blocks=2, num_tokens=65, block_size=16) == 2
    assert loadable_blocks(hit_blocks=0, num_tokens=1, block_size=16) == 0
    assert external_tokens(hit_blocks=1, num_tokens=16, num_computed=0, block_size=16) == 15
    assert external_tokens(hit_blocks=0, num_tokens=1, num_computed=0, block_size=16) == 0


def test_a_load_spans_the_partly_claimed_last_block() -> None:
    assert blocks_spanned(63, 16) == 4
    assert blocks_spanned(64, 16) == 4
    assert blocks_spanned(0, 16) == 0


def test_external_tokens_are_beyond_what_vllm_has_locally() -> None:
    assert external_tokens(hit_blocks=4, num_tokens=100, num_computed=32, block_size=16) == 32
    assert external_tokens(hit_blocks=2, num_tokens=100, num_computed=48, block_size=16) == 0
    # vLLM's own cache gives up a whole-block prompt's last block; kvstored supplies it, short of a token
    assert external_tokens(hit_blocks=4, num_tokens=64, num_computed=48, block_size=16) == 15


def test_each_chunk_stores_the_blocks_it_completed() -> None:
    planner = SavePlanner(block_size=16)
    planner.started("r", [10, 11, 12], already_stored=0)
    first = planner.due("r", computed_tokens=40, hashes=H[:2])          # a 40-token chunk: 2 whole blocks
    assert first is not None and (first.hashes, first.block_ids, first.first) == (tuple(H[:2]), (10, 11), 0)
    planner.grew("r", [13, 14])
    second = planner.due("r", computed_tokens=80, hashes=H[:5])
    assert second is not None and (second.block_ids, second.first) == ((10, 11, 12, 13, 14), 2)
    assert planner.due("r", computed_tokens=81, hashes=H[:5]) is None   # no new whole block


def test_blocks_loaded_from_kvstored_are_not_stored_again() -> None:
    planner = SavePlanner(block_size=16)
    planner.started("r", [1, 2, 3, 4], already_stored=3)
    assert planner.due("r", computed_tokens=50, hashes=H[:3]) is None
    spec = planner.due("r", computed_tokens=64, hashes=H[:4])
    assert spec is not None and spec.first == 3 and len(spec.block_ids) == 4


def test_a_finished_or_unknown_request_stores_nothing() -> None:
    planner = SavePlanner(block_size=16)
    planner.started("r", [1], already_stored=0)
    planner.finished("r")
    assert "r" not in planner
    assert planner.due("r", computed_tokens=16, hashes=H[:1]) is None
