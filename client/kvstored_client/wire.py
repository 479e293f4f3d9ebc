"""Conversions between SDK values and their protobuf messages, shared by the SDK and the daemon."""

from __future__ import annotations

import dataclasses

from kvstored_client._proto import kvstored_pb2 as pb
from kvstored_client.namespace import Namespace

_FIELDS = [f.name for f in dataclasses.fields(Namespace)]


def namespace_to_pb(ns: Namespace) -> pb.NamespaceSpec:
    return pb.NamespaceSpec(**{name: getattr(ns, name) for name in _FIELDS})


def namespace_from_pb(msg: pb.NamespaceSpec) -> Namespace:
    return Namespace(**{name: getattr(msg, name) for name in _FIELDS})
