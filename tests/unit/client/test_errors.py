"""Which SDK error a daemon status becomes (README: every failure is a KVStoreError subclass):
by the reason the daemon gives, never by its message; by the status code alone from a daemon
that gives none."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

import kvstored
from kvstored_client.contract.errors import DOMAIN, Cancelled, Reason
from kvstored_client.errors import _BY_REASON, from_rpc_error, reason_of


class Status(grpc.RpcError):
    """A failed call as grpc raises it: with ``reason``, the rich status a daemon sends in its
    trailer (an ErrorInfo of ``domain``); without, a status code and message alone."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str | None = None,
                 domain: str = DOMAIN) -> None:
        self._code, self._details = code, details
        self._trailer: tuple[tuple[str, bytes], ...] = ()
        if reason is not None:
            info = any_pb2.Any()
            info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain))
            rich = status_pb2.Status(code=code.value[0], message=details, details=[info])
            self._trailer = (("grpc-status-details-bin", rich.SerializeToString()),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailer


@pytest.mark.parametrize(("code", "details", "cls"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "block_ids[1] = 9 out of range", kvstored.InvalidArgument),
    (grpc.StatusCode.NOT_FOUND, "unknown buffers 7", kvstored.NotFound),
    (grpc.StatusCode.FAILED_PRECONDITION, "peers are off", kvstored.FailedPrecondition),
    # no reason, no LeaseExpired: the message is never read (a daemon older than reasons)
    (grpc.StatusCode.FAILED_PRECONDITION, "lease 3 expired before it was released", kvstored.FailedPrecondition),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", kvstored.ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, "connect failed", kvstored.DaemonNotRunning),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", kvstored.DeadlineExceeded),
    (grpc.StatusCode.INTERNAL, "a bug", kvstored.KVStoreError),
])
def test_a_status_without_a_reason_becomes_its_codes_sdk_error(code: grpc.StatusCode, details: str,
                                                                cls: type) -> None:
    err = from_rpc_error(Status(code, details))
    assert type(err) is cls and isinstance(err, kvstored.KVStoreError)
    assert str(err) == details and err.code == code
    assert err.reason == (cls.default_reason if cls is not kvstored.KVStoreError else Reason.UNKNOWN)


@pytest.mark.parametrize(("code", "reason", "cls"), [
    (grpc.StatusCode.FAILED_PRECONDITION, Reason.LEASE_EXPIRED, kvstored.LeaseExpired),
    (grpc.StatusCode.FAILED_PRECONDITION, Reason.RESERVATION_EXPIRED, kvstored.LeaseExpired),
    (grpc.StatusCode.FAILED_PRECONDITION, Reason.UNKNOWN_SESSION, kvstored.FailedPrecondition),
    (grpc.StatusCode.NOT_FOUND, Reason.UNKNOWN_NAMESPACE, kvstored.NotFound),
    (grpc.StatusCode.INVALID_ARGUMENT, Reason.TOO_MANY_BLOCKS, kvstored.InvalidArgument),
    (grpc.StatusCode.INVALID_ARGUMENT, Reason.MALFORMED_REQUEST, kvstored.InvalidArgument),
    (grpc.StatusCode.UNAVAILABLE, Reason.DAEMON_STOPPING, kvstored.DaemonNotRunning),
    (grpc.StatusCode.CANCELLED, Reason.STREAM_ENDED, Cancelled),
])
def test_the_reason_decides_whatever_the_message_says(code: grpc.StatusCode, reason: Reason, cls: type) -> None:
    """An expired lease whose message no longer says "expired" is still LeaseExpired; an
    unknown namespace is told by its reason, not by a message starting "unknown namespace"."""
    err = from_rpc_error(Status(code, "reworded by a later daemon", reason.value))
    assert type(err) is cls and err.reason is reason and err.code == code
    assert str(err) == "reworded by a later daemon"


def test_a_reason_of_another_domain_newer_than_the_sdk_or_of_another_code_falls_back_to_the_code() -> None:
    other = from_rpc_error(Status(grpc.StatusCode.FAILED_PRECONDITION, "x", Reason.LEASE_EXPIRED, domain="etcd"))
    assert type(other) is kvstored.FailedPrecondition and other.reason == Reason.FAILED_PRECONDITION
    newer = from_rpc_error(Status(grpc.StatusCode.NOT_FOUND, "x", "UNKNOWN_GALAXY"))
    assert type(newer) is kvstored.NotFound and newer.reason == "UNKNOWN_GALAXY"
    mismatched = from_rpc_error(Status(grpc.StatusCode.NOT_FOUND, "x", Reason.LEASE_EXPIRED))
    assert type(mismatched) is kvstored.NotFound and mismatched.reason == Reason.NOT_FOUND


def test_a_call_cancelled_without_a_reason_was_cancelled_by_a_stopping_daemon() -> None:
    err = from_rpc_error(Status(grpc.StatusCode.CANCELLED, "Cancelled"), "kvstored on /run/kv.sock", 5.0)
    assert type(err) is kvstored.DaemonNotRunning and "/run/kv.sock" in str(err) and "stopping" in str(err)


def test_every_reason_has_one_class_that_travels_as_its_code() -> None:
    """The daemon raises a class with a reason; the SDK finds the class again from the reason: a
    reason no table knows, or a class's generic reason mapped elsewhere, would lose it."""
    assert set(_BY_REASON) == set(Reason) - {Reason.UNKNOWN, Reason.CLIENT_CLOSED}
    for reason, cls in _BY_REASON.items():
        assert from_rpc_error(Status(cls.code, "m", reason)).__class__ is cls
        assert _BY_REASON[cls.default_reason] is cls
    assert kvstored.ClientClosed().reason == Reason.CLIENT_CLOSED


def test_reason_of_reads_nothing_from_errors_that_are_not_a_daemons() -> None:
    assert reason_of(Status(grpc.StatusCode.UNAVAILABLE, "failed to connect")) is None
    assert reason_of(grpc.RpcError()) is None   # not a call: no trailer at all
    assert reason_of(Status(grpc.StatusCode.NOT_FOUND, "x", Reason.UNKNOWN_LEASE)) is Reason.UNKNOWN_LEASE


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


def _bare_client(namespace_ids: dict[kvstored.Namespace, tuple[int, kvstored.Namespace]]) -> object:
    from kvstored_client.client import Client

    client = Client.__new__(Client)   # no daemon needed: only how a status becomes an error
    client.socket, client._timeout, client._closed, client._namespace_ids = "/run/kv.sock", 5.0, False, namespace_ids
    client._fast = None   # every call by the stub given
    client._write_behind = None   # (no fast path: no saves in flight)
    return client


def test_a_namespace_the_daemon_lost_is_opened_again_by_its_reason() -> None:
    """A restarted daemon that lost a namespace refuses calls naming its id: the client opens
    it again and retries once, told so by the reason (whatever the message says)."""
    from types import SimpleNamespace

    ns = kvstored.Namespace(model="m")
    client: Any = _bare_client({ns: (3, ns)})
    client._check_open = lambda: None
    client._ns = lambda namespace: (4, namespace)   # as the restarted daemon numbers it
    sent: list[int] = []

    def lookup(request: Any, timeout: float) -> str:
        sent.append(request.namespace_id)
        if len(sent) == 1:
            raise Status(grpc.StatusCode.NOT_FOUND, "no such thing here", Reason.UNKNOWN_NAMESPACE.value)
        return "answered"

    assert client._call(lookup, SimpleNamespace(namespace_id=3)) == "answered" and sent == [3, 4]
    # no reason (a daemon older than reasons): no retry, but the ids are asked for again next time
    client._namespace_ids[ns] = (3, ns)
    sent.clear()

    def refuse(request: Any, timeout: float) -> str:
        sent.append(request.namespace_id)
        raise Status(grpc.StatusCode.NOT_FOUND, "unknown namespace 3: open it first")

    with pytest.raises(kvstored.NotFound):
        client._call(refuse, SimpleNamespace(namespace_id=3))
    assert sent == [3] and client._namespace_ids == {}


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
