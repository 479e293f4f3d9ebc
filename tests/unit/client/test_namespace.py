"""Namespace identity: what makes blocks interchangeable, and what may not collide."""

from __future__ import annotations

import pytest

from kvstored_client.contract.namespace import Namespace


def test_fields_holding_the_identity_separator_cannot_make_two_namespaces_one() -> None:
    """identity() joins 'key=value' with a control character: a model and revision crafted around
    it gave two different namespaces one id, so each would serve the other's blocks."""
    a = Namespace(model="m\x1frevision=r", revision="")
    b = Namespace(model="m", revision="r\x1frevision=")
    assert a.identity() == b.identity()   # why validate() must refuse them
    for ns in (a, b):
        with pytest.raises(ValueError, match="control character"):
            ns.validate()
    Namespace(model="meta-llama/Llama-3-8B", revision="main", kv_dtype="bfloat16").validate()
    Namespace(model="with\ttab").validate()   # other control characters cannot collide: still taken


def test_block_bytes_is_not_part_of_the_identity() -> None:
    assert Namespace(model="x", block_bytes=0).identity() == Namespace(model="x", block_bytes=4096).identity()
    assert Namespace(model="x").identity() != Namespace(model="y").identity()


@pytest.mark.parametrize("fields", [{"model": 7}, {"hash_seed": 0}, {"revision": None}, {"kv_dtype": b"bf16"},
                                    {"block_size": "16"}, {"block_size": 16.0}, {"tp_rank": True},
                                    {"block_bytes": 1.5}])
def test_fields_of_the_wrong_type_are_named(fields: dict[str, object]) -> None:
    """Was: hash_seed=0 or model=7 failed as "argument of type 'int' is not iterable", a float
    block size as "'float' object cannot be interpreted as an integer", naming no field."""
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"namespace.{name} must be an? (str|int), got"):
        Namespace(**fields).validate()   # type: ignore[arg-type]
