"""Errors the SDK raises; each daemon status code maps to one class here."""

from __future__ import annotations

import grpc


class KVStoreError(Exception):
    """Base of every SDK error. ``code`` is the gRPC status the daemon answered with, if any."""

    code: grpc.StatusCode | None = None


class DaemonNotRunning(KVStoreError):
    """No daemon answers on the socket."""

    code = grpc.StatusCode.UNAVAILABLE


class InvalidArgument(KVStoreError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVStoreError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KVStoreError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class LeaseExpired(FailedPrecondition):
    """A lease or reservation ended before the call that needed it: bytes read may be stale,
    bytes written were not stored."""


class ResourceExhausted(KVStoreError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(KVStoreError, TimeoutError):
    """The daemon did not answer within the client's ``timeout_s`` (it may be overloaded or stuck)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ClientClosed(KVStoreError):
    """The client was closed; make a new one."""


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: DaemonNotRunning,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def from_rpc_error(exc: grpc.RpcError) -> KVStoreError:
    """The SDK error for a failed call (an 'expired' precondition becomes LeaseExpired)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, KVStoreError) if code is not None else KVStoreError
    if cls is FailedPrecondition and "expired" in (details or ""):
        cls = LeaseExpired
    err = cls(details or str(code))
    err.code = code
    return err
