"""Conversions between SDK values and their protobuf messages, shared by the SDK and the daemon."""

from __future__ import annotations

import dataclasses

from kvstored_client.contract.hashing import DEFAULT_ALGO
from kvstored_client.contract.namespace import Namespace
from kvstored_client.contract.proto import kvstored_pb2 as pb

_FIELDS = [f.name for f in dataclasses.fields(Namespace)]


def namespace_to_pb(ns: Namespace) -> pb.NamespaceSpec:
    return pb.NamespaceSpec(**{name: getattr(ns, name) for name in _FIELDS})


def namespace_from_pb(msg: pb.NamespaceSpec) -> Namespace:
    """The namespace a message names; an empty ``hash_algo`` (a raw client that left it out, as
    proto3 lets it) is the default algorithm, as the proto says, so it names the SDK's namespace."""
    fields = {name: getattr(msg, name) for name in _FIELDS}
    if not fields["hash_algo"]:
        fields["hash_algo"] = DEFAULT_ALGO
    return Namespace(**fields)
