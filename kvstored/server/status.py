"""The one place where domain errors become gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvstored import errors

log = logging.getLogger("kvstored.server")

STATUS: dict[type[errors.KVError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
}

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def code_for(exc: errors.KVError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]  # type: ignore[index]
    return grpc.StatusCode.UNKNOWN


# gRPC carries a status message in the grpc-message header, percent-encoded (3 bytes for each
# UTF-8 byte outside printable ASCII); a client refuses headers past its metadata limit (8 KiB soft,
# 16 KiB hard by default) and reports RESOURCE_EXHAUSTED "received metadata size exceeds ...
# limit" in place of the status sent. A message echoing a long request field (a model name) is
# cut to this many encoded bytes.
MAX_DETAILS_BYTES = 4000


def details(exc: errors.KVError) -> str:
    """The status message for ``exc``: its text, cut short when it would not reach the client."""
    text = str(exc)
    cost = 0
    for i, ch in enumerate(text):
        cost += 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "surrogatepass"))
        if cost > MAX_DETAILS_BYTES:
            return text[:i] + f"... ({len(text) - i} more characters cut)"
    return text


async def abort(context: grpc.aio.ServicerContext, exc: errors.KVError) -> None:
    """End the call with ``exc``'s status code and message (raises, as ``context.abort`` does)."""
    await context.abort(code_for(exc), details(exc))


def mapped(handler: F) -> F:
    """Wrap a servicer method: KVError -> its status code with the message; nothing else caught."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except errors.KVError as exc:
            await abort(context, exc)

    return wrapper  # type: ignore[return-value]
