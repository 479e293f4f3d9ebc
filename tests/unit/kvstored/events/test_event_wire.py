"""The KV event format: vLLM's map form both ways, its older array form read, bad input refused."""

from __future__ import annotations

import msgpack
import pytest

from kvstored.events.wire import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    HashFormat,
    WireError,
    decode_batch,
    encode_batch,
    epoch_of,
    hash64,
    make_seq,
    medium_rank,
    wire_hash,
)


def test_a_batch_round_trips_and_is_vllms_map_form() -> None:
    batch = Batch(1.5, (BlockStored((1, 2), None, 16, "CPU", namespace_id=7), BlockRemoved((3,), "DISK"),
                        AllBlocksCleared()), 0)
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgpack.unpackb(payload)
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_hashes"] == [1, 2]
    assert raw[1][0]["token_ids"] == [] and raw[1][0]["lora_name"] is None and raw[1][0]["medium"] == "CPU"
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_the_older_array_form_is_read() -> None:
    payload = msgpack.packb([2.0, [["BlockStored", [5, 6], 4, [1] * 32, 16, None, "GPU"],
                                   ["BlockRemoved", [5], None], ["AllBlocksCleared"]], None])
    assert decode_batch(payload).events == (BlockStored((5, 6), 4, 16, "GPU"), BlockRemoved((5,), "GPU"),
                                            AllBlocksCleared())


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0, [{"type": "Nope"}]]),
                                     msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
                                     msgpack.packb(["t", []]), msgpack.packb([1.0, [[]]])])
def test_bad_payloads_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_hashes_and_seq() -> None:
    key = bytes(range(32))
    assert wire_hash(key, HashFormat.BYTES) == key
    assert wire_hash(key, HashFormat.INT64) == int.from_bytes(key[-8:], "big") == hash64(key)
    assert hash64(-1) == (1 << 64) - 1
    seq = make_seq(5, 9)
    assert epoch_of(seq) == 5 and seq & 0xFF == 9
    with pytest.raises(ValueError):
        make_seq(1 << 23, 0)
    assert [medium_rank(m) for m in ("GPU", "CPU", "cpu_pinned", "CPU_TIER2", "DISK", "NVME")] == [0, 1, 1, 2, 2, 2]
