"""Which gRPC target a ``socket`` argument names."""

from __future__ import annotations

import pytest

from kvstored_client.connection import _target


@pytest.mark.parametrize(("socket", "target"), [
    ("/run/kvstored/kvstored.sock", "unix:/run/kvstored/kvstored.sock"),
    ("kv.sock", "unix:kv.sock"),
    ("./host:1", "unix:./host:1"),
    ("127.0.0.1:7373", "dns:127.0.0.1:7373"),
    ("node-3.cluster:7373", "dns:node-3.cluster:7373"),
    ("[::1]:7373", "dns:[::1]:7373"),
    ("ipv4:127.0.0.1:7373", "ipv4:127.0.0.1:7373"),
    ("unix:/tmp/x.sock", "unix:/tmp/x.sock"),
])
def test_socket_paths_and_host_port(socket: str, target: str) -> None:
    assert _target(socket) == target
