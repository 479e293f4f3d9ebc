"""The failures a call ends with, as the daemon raises them and the SDK raises them to its caller.

Each class travels as one gRPC status code (``code``); each failure also carries a ``reason``
(:class:`Reason`) that says which of the class's cases it is, on the wire as a
``google.rpc.ErrorInfo`` (domain :data:`DOMAIN`) in the status details. The daemon maps an error
to its status in one place (``kvstored/server/status.py``), the SDK a status back to an error in
one place (``kvstored_client/errors.py``); neither reads the message, which is for people.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import grpc

DOMAIN = "kvstored"


class Reason(enum.StrEnum):
    """Why a call failed, finer than its class. Each class has a generic reason, named after its
    status code, for the cases nobody needs to tell apart; a reason belongs to one class."""

    UNKNOWN = "UNKNOWN"                          # KVStoreError itself: not an expected failure
    INVALID_ARGUMENT = "INVALID_ARGUMENT"        # InvalidArgument
    BAD_KEYS = "BAD_KEYS"                        # the chain's keys: malformed hashes or token ids
    TOO_MANY_BLOCKS = "TOO_MANY_BLOCKS"          # more blocks than server.max_batch_blocks: split the call
    MALFORMED_REQUEST = "MALFORMED_REQUEST"      # the request's bytes are not the method's message
    NOT_FOUND = "NOT_FOUND"                      # NotFound
    UNKNOWN_NAMESPACE = "UNKNOWN_NAMESPACE"      # a namespace id the daemon does not know (a restart): open it again
    UNKNOWN_LEASE = "UNKNOWN_LEASE"              # a lease or reservation id the session does not hold
    UNKNOWN_BUFFERS = "UNKNOWN_BUFFERS"          # a buffers id the session did not register (or unregistered)
    UNKNOWN_MODEL = "UNKNOWN_MODEL"              # a model the node has never seen
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # FailedPrecondition
    UNKNOWN_SESSION = "UNKNOWN_SESSION"          # a session the daemon does not have (ended, or a restart)
    SSD_DISABLED = "SSD_DISABLED"                # an SSD-tier operation on a node without one
    PEERS_OFF = "PEERS_OFF"                      # a peer operation on a node without peers
    LEASE_EXPIRED = "LEASE_EXPIRED"              # LeaseExpired: a read lease ended first (bytes may be stale)
    RESERVATION_EXPIRED = "RESERVATION_EXPIRED"  # LeaseExpired: a reservation ended first (nothing stored)
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"    # ResourceExhausted
    TIER_FULL = "TIER_FULL"                      # DRAM cannot make room: all it could evict is leased or written
    UNAVAILABLE = "UNAVAILABLE"                  # DaemonNotRunning: no daemon answers
    DAEMON_STOPPING = "DAEMON_STOPPING"          # DaemonNotRunning: the daemon is shutting down
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"      # DeadlineExceeded
    STREAM_ENDED = "STREAM_ENDED"                # Cancelled: the client ended the stream (EndStream)
    CLIENT_CLOSED = "CLIENT_CLOSED"              # the SDK's ClientClosed; never sent by a daemon


class KVStoreError(Exception):
    """Base of every expected failure; the message says what was wrong, to a person.

    ``code``: the gRPC status it travels as (on an error the SDK raised for a failed call: the
    status the daemon answered with). ``reason``: a :class:`Reason` (a plain ``str`` for one
    this SDK does not know yet), the class's generic one unless a finer one was given.
    """

    code: grpc.StatusCode | None = None
    default_reason: ClassVar[Reason] = Reason.UNKNOWN

    def __init__(self, message: str = "", reason: str | None = None) -> None:
        super().__init__(message)
        self.reason: str = reason if reason is not None else self.default_reason


class InvalidArgument(KVStoreError, ValueError):
    """Malformed or inconsistent input; nothing was changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = Reason.INVALID_ARGUMENT


class NotFound(KVStoreError):
    """An unknown namespace, lease, buffer set, model or peer."""

    code = grpc.StatusCode.NOT_FOUND
    default_reason = Reason.NOT_FOUND


class FailedPrecondition(KVStoreError):
    """The call is valid but the state does not allow it (an ended session, no SSD tier, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = Reason.FAILED_PRECONDITION


class LeaseExpired(FailedPrecondition):
    """A lease or reservation ended before the call that needed it: bytes read may be stale,
    bytes written were not stored."""

    default_reason = Reason.LEASE_EXPIRED


class ResourceExhausted(KVStoreError):
    """A tier, or the daemon, cannot make room for what the call needs."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = Reason.RESOURCE_EXHAUSTED


class DaemonNotRunning(KVStoreError):
    """No daemon answers on the socket, or the one there is stopping."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = Reason.UNAVAILABLE


class DeadlineExceeded(KVStoreError, TimeoutError):
    """The call's deadline passed first: the daemon did not answer within the client's
    ``timeout_s`` (overloaded or stuck), or, in the daemon, the client has given up on the call,
    so no more of its work is done (no copy into the client's engine buffers starts)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = Reason.DEADLINE_EXCEEDED


class Cancelled(KVStoreError):
    """The client ended the call's work (EndStream) before it was done."""

    code = grpc.StatusCode.CANCELLED
    default_reason = Reason.STREAM_ENDED
