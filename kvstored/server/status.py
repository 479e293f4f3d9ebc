"""The one place where domain errors become gRPC statuses.

A :class:`~kvstored_client.contract.errors.KVStoreError` ends the call with its class's status
code, its message, and its reason as a ``google.rpc.ErrorInfo`` (domain "kvstored") in the
status details (the ``grpc-status-details-bin`` trailer: gRPC's rich status, read by the SDK
with grpcio-status). Anything else escaping a handler is a bug and surfaces as UNKNOWN (grpc's
"Unexpected <class ...>: ..."), which the SDK raises as a plain ``KVStoreError``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvstored.rpc_guard import heard
from kvstored_client.contract.errors import DOMAIN, KVStoreError

log = logging.getLogger("kvstored.server")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# A status message travels twice: percent-encoded in the grpc-message header (3 bytes for each
# UTF-8 byte outside printable ASCII), and inside the rich status in grpc-status-details-bin,
# base64-encoded (4 bytes for each 3). A client refuses headers past its metadata limit (8 KiB
# soft, 16 KiB hard by default) and reports RESOURCE_EXHAUSTED "received metadata size exceeds
# ... limit" in place of the status sent: a message echoing a long request field (a model name)
# is cut to this many bytes, both copies together.
MAX_DETAILS_BYTES = 6000


def details(exc: KVStoreError) -> str:
    """The status message for ``exc``: its text, cut short when it would not reach the client."""
    text = str(exc)
    cost = 0   # in thirds of a byte: base64 costs 4/3 of a byte per byte
    for i, ch in enumerate(text):
        size = len(ch.encode("utf-8", "surrogatepass"))
        cost += 3 * (1 if " " <= ch <= "~" and ch != "%" else 3 * size) + 4 * size
        if cost > 3 * MAX_DETAILS_BYTES:
            return text[:i] + f"... ({len(text) - i} more characters cut)"
    return text


def status_message(exc: KVStoreError) -> status_pb2.Status:
    """``exc`` as a ``google.rpc.Status``: code, message and reason (gRPC sends it in the
    ``grpc-status-details-bin`` trailer, the fast path as a failed call's answer)."""
    code = exc.code or grpc.StatusCode.UNKNOWN
    # (protobuf refuses a lone surrogate, which an OS error's text may hold; grpc-message the same)
    message = details(exc).encode("utf-8", "replace").decode("utf-8")
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=str(exc.reason), domain=DOMAIN))
    return status_pb2.Status(code=code.value[0], message=message, details=[info])


def rich_status(exc: KVStoreError) -> grpc.Status:
    """``exc`` as the status a call ends with: code, message and reason."""
    status: grpc.Status = rpc_status.to_status(status_message(exc))
    return status


async def abort(context: grpc.aio.ServicerContext, exc: KVStoreError) -> None:
    """End the call with ``exc``'s status (raises, as ``context.abort`` does)."""
    heard(exc)   # counted (and maybe logged) as the client's mistake by the request guard
    status = rich_status(exc)
    await context.abort(status.code, status.details, status.trailing_metadata)


def mapped(handler: F) -> F:
    """Wrap a servicer method: KVStoreError -> its status; nothing else caught."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except KVStoreError as exc:
            await abort(context, exc)

    return wrapper  # type: ignore[return-value]
