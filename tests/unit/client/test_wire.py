"""Namespace messages both ways: what a raw gRPC client sends names the SDK's namespace."""

from __future__ import annotations

from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.contract.wire import namespace_from_pb, namespace_to_pb


def test_a_namespace_goes_through_its_message_unchanged() -> None:
    ns = Namespace(model="m", revision="r", kv_dtype="bfloat16", block_size=32, tp_rank=1, tp_size=2,
                   hash_algo="xxh3_128", hash_seed="7", block_bytes=4096)
    assert namespace_from_pb(namespace_to_pb(ns)) == ns


def test_a_message_without_hash_algo_names_the_default_algorithm() -> None:
    # Was: "" went through as the algorithm and the daemon refused the namespace, though the proto
    # calls sha256_cbor the default (and proto3 gives raw clients "" for a field left out).
    msg = pb.NamespaceSpec(model="m", block_size=16, tp_size=1, hash_seed="0")
    ns = namespace_from_pb(msg)
    ns.validate()
    assert ns.identity() == Namespace(model="m").identity()
