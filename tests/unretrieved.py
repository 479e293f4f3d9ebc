"""Running a coroutine to its end and collecting what asyncio reports as "never retrieved" (an
exception of a task or future nobody awaited), which a daemon logs as if it had crashed."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any


def unretrieved_errors(main: Callable[[], Coroutine[Any, Any, None]]) -> list[dict[str, Any]]:
    """Run ``main()`` in a new event loop; the loop's exception-handler reports of exceptions
    never retrieved, during the run or once what it left is collected."""
    logged: list[dict[str, Any]] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: logged.append(ctx))
        await main()
        gc.collect()

    asyncio.run(run())
    gc.collect()
    return [ctx for ctx in logged if "never retrieved" in str(ctx.get("message", ""))]
