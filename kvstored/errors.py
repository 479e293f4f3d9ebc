"""Expected failures of the daemon's domain, as typed errors.

The server maps each class to one gRPC status code in one place (``server/status.py``); anything
else escaping a handler is a bug and surfaces as UNKNOWN (grpc's "Unexpected <class ...>: ..."),
which the SDK raises as a plain ``KVStoreError``.
"""

from __future__ import annotations


class KVError(Exception):
    """Base of expected failures; the message is shown to the client as is."""


class InvalidArgument(KVError):
    """Malformed or inconsistent input; nothing was changed."""


class NotFound(KVError):
    """An unknown namespace, buffer set or session."""


class FailedPrecondition(KVError):
    """The call is valid but the state does not allow it (e.g. a lease already expired)."""


class ResourceExhausted(KVError):
    """A tier cannot make room (everything evictable is leased or reserved)."""


class Unavailable(KVError):
    """The daemon is shutting down."""


class DeadlineExceeded(KVError):
    """The call's deadline passed before the work was done: its client has given up on it (a
    daemon frozen, or starved, past it), so no more of it is done (no copy into the client's
    engine buffers starts: the engine may be reusing those blocks)."""


class Cancelled(KVError):
    """The client ended the call's work (EndStream) before it was done."""
