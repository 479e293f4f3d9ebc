"""Which SDK error a daemon status becomes (README: every failure is a KVStoreError subclass)."""

from __future__ import annotations

import grpc
import pytest

import kvstored
from kvstored_client.errors import from_rpc_error


class Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(("code", "details", "cls"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "block_ids[1] = 9 out of range", kvstored.InvalidArgument),
    (grpc.StatusCode.NOT_FOUND, "unknown buffers 7", kvstored.NotFound),
    (grpc.StatusCode.FAILED_PRECONDITION, "peers are off", kvstored.FailedPrecondition),
    (grpc.StatusCode.FAILED_PRECONDITION, "lease 3 expired before it was released", kvstored.LeaseExpired),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", kvstored.ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, "connect failed", kvstored.DaemonNotRunning),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", kvstored.DeadlineExceeded),
    (grpc.StatusCode.INTERNAL, "a bug", kvstored.KVStoreError),
])
def test_each_status_becomes_its_sdk_error_with_the_daemons_reason(code: grpc.StatusCode, details: str,
                                                                    cls: type) -> None:
    err = from_rpc_error(Status(code, details))
    assert type(err) is cls and isinstance(err, kvstored.KVStoreError)
    assert str(err) == details and err.code == code


def test_sdk_errors_are_also_the_builtin_errors_callers_catch() -> None:
    assert issubclass(kvstored.InvalidArgument, ValueError)
    assert issubclass(kvstored.DeadlineExceeded, TimeoutError)
    assert issubclass(kvstored.LeaseExpired, kvstored.FailedPrecondition)
    for name in ("ClientClosed", "DaemonNotRunning", "NotFound", "ResourceExhausted"):
        assert issubclass(getattr(kvstored, name), kvstored.KVStoreError)


def test_a_call_the_daemon_cancelled_is_daemon_not_running() -> None:
    """Was: a daemon stopping (SIGTERM) cancels the calls that reach it meanwhile, and the SDK
    raised a bare KVStoreError("CANCELLED"), which says nothing a caller can act on; the daemon
    went away, as with UNAVAILABLE."""
    from kvstored_client.client import Client

    client = Client.__new__(Client)   # no daemon needed: only how a status becomes an error
    client.socket, client._timeout, client._closed, client._namespace_ids = "/run/kv.sock", 5.0, False, {}
    err = client._error(Status(grpc.StatusCode.CANCELLED, "CANCELLED"))
    assert type(err) is kvstored.DaemonNotRunning and "/run/kv.sock" in str(err)


def test_a_client_made_while_the_daemon_stops_raises_daemon_not_running(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Was: ``Client()`` against a daemon in the middle of stopping (its server cancels the Hello)
    raised a bare KVStoreError("CANCELLED") instead of DaemonNotRunning."""
    from concurrent import futures

    from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc

    class Stopping(pb_grpc.KVStoreServicer):
        def Hello(self, request, context):  # type: ignore[no-untyped-def]
            context.abort(grpc.StatusCode.CANCELLED, "")

    socket = str(tmp_path / "kv.sock")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_KVStoreServicer_to_server(Stopping(), server)
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    try:
        with pytest.raises(kvstored.DaemonNotRunning, match="stopping"):
            kvstored.Client(socket)
    finally:
        server.stop(None)
