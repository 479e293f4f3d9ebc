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


def mapped(handler: F) -> F:
    """Wrap a servicer method: KVError -> its status code with the message; nothing else caught."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except errors.KVError as exc:
            await context.abort(code_for(exc), str(exc))

    return wrapper  # type: ignore[return-value]
