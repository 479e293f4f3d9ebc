"""The one place where a failed call becomes the SDK error it raises: by the daemon's reason, else
by status code. The error types are the contract's (:mod:`kvstored_client.contract.errors`);
:class:`ClientClosed` is the SDK's own.

A daemon older than reasons sends a status code alone: its errors map by the code (an expired
lease is then a plain FailedPrecondition, LeaseExpired's base), with the class's generic reason.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvstored_client.contract.errors import (
    DOMAIN,
    Cancelled,
    DaemonNotRunning,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    NotFound,
    Reason,
    ResourceExhausted,
)


class ClientClosed(KVStoreError):
    """The client was closed; make a new one."""

    default_reason = Reason.CLIENT_CLOSED


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: DaemonNotRunning,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    # with no reason: the daemon's server cancelled the call as it stopped (ours carry STREAM_ENDED)
    grpc.StatusCode.CANCELLED: DaemonNotRunning,
}

_BY_REASON: dict[str, type[KVStoreError]] = {
    Reason.INVALID_ARGUMENT: InvalidArgument,
    Reason.BAD_KEYS: InvalidArgument,
    Reason.TOO_MANY_BLOCKS: InvalidArgument,
    Reason.MALFORMED_REQUEST: InvalidArgument,
    Reason.NOT_FOUND: NotFound,
    Reason.UNKNOWN_NAMESPACE: NotFound,
    Reason.UNKNOWN_LEASE: NotFound,
    Reason.UNKNOWN_BUFFERS: NotFound,
    Reason.UNKNOWN_MODEL: NotFound,
    Reason.FAILED_PRECONDITION: FailedPrecondition,
    Reason.UNKNOWN_SESSION: FailedPrecondition,
    Reason.SSD_DISABLED: FailedPrecondition,
    Reason.PEERS_OFF: FailedPrecondition,
    Reason.LEASE_EXPIRED: LeaseExpired,
    Reason.RESERVATION_EXPIRED: LeaseExpired,
    Reason.RESOURCE_EXHAUSTED: ResourceExhausted,
    Reason.TIER_FULL: ResourceExhausted,
    Reason.UNAVAILABLE: DaemonNotRunning,
    Reason.DAEMON_STOPPING: DaemonNotRunning,
    Reason.DEADLINE_EXCEEDED: DeadlineExceeded,
    Reason.STREAM_ENDED: Cancelled,
}


def reason_of(exc: grpc.RpcError) -> str | None:
    """The reason the daemon gave for a failed call (its ErrorInfo of domain ``kvstored``), as a
    :class:`Reason` when this SDK knows it; None when it gave none (a daemon older than reasons,
    or a status grpc made itself: no connection, a deadline passed here)."""
    try:
        status = rpc_status.from_call(exc)
    except (AttributeError, TypeError, ValueError, DecodeError):
        # not a call's error (no trailing metadata), or details that do not match the status
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:
            try:
                return Reason(info.reason)
            except ValueError:   # a daemon newer than this SDK
                return info.reason
    return None


def from_rpc_error(exc: grpc.RpcError, daemon: str = "", timeout_s: float | None = None) -> KVStoreError:
    """The SDK error for a failed call: the class of the daemon's reason, or of the status code
    when it gave none (or one whose class travels as another code); any other status (a bug in
    the daemon: UNKNOWN, INTERNAL) is a plain KVStoreError. With ``daemon`` (e.g. "kvstored on
    /run/kvstored/kvstored.sock"), errors that grpc reports rather than the daemon say which
    daemon went away or did not answer within ``timeout_s``."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    reason = reason_of(exc)
    known = _BY_REASON.get(reason) if reason is not None else None
    if known is not None and known.code == code:
        cls = known
    else:   # no reason, one newer than this SDK, or one whose class travels as another code
        cls = _BY_CODE.get(code, KVStoreError) if code is not None else KVStoreError
    message = details or str(code)
    if daemon:
        if cls is DaemonNotRunning and code == grpc.StatusCode.CANCELLED:
            message = f"{daemon} cancelled the call: it is stopping"
        elif cls is DaemonNotRunning:
            message = f"{daemon} went away: {details}"
        elif cls is DeadlineExceeded:
            within = "in time" if timeout_s is None else f"within {timeout_s:g} s (Client timeout_s)"
            message = f"{daemon} did not answer {within}"
    err = cls(message, reason if reason is not None and known in (None, cls) else None)
    err.code = code
    return err
