"""A bare gRPC unary echo on a Unix socket: the floor for kvstored's small calls.

The server is what the daemon runs (``grpc.aio`` on uvloop when available) with one method and no
protobuf; it lives in its own process, like the daemon. The client is a sync channel, like the SDK.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tools.bench.common import python_env, wait_for

METHOD = "/kvbench.Echo/Call"


def _identity(b: bytes) -> bytes:
    return b


async def _serve(path: str) -> None:
    server = grpc.aio.server()

    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler("kvbench.Echo", {
        "Call": grpc.unary_unary_rpc_method_handler(call, request_deserializer=_identity,
                                                    response_serializer=_identity)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    deadline = time.monotonic() + 1800  # bounded even if nobody stops it
    while time.monotonic() < deadline and os.getppid() != 1:
        await asyncio.sleep(0.5)
    await server.stop(1)


class Server:
    """The echo server in a child process; a context manager that always stops it."""

    def __enter__(self) -> Server:
        self._dir = tempfile.mkdtemp(prefix="kvbench-grpc-")
        self.path = str(Path(self._dir) / "echo.sock")
        self._proc = subprocess.Popen([sys.executable, "-m", "tools.bench.baregrpc", self.path],
                                      env=python_env(), stdin=subprocess.DEVNULL)
        wait_for(lambda: os.path.exists(self.path), 30, "bare gRPC server", self._proc)
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self._dir)


class Client:
    def __init__(self, path: str) -> None:
        self._channel = grpc.insecure_channel(f"unix:{path}")
        self._call = self._channel.unary_unary(METHOD, request_serializer=_identity,
                                               response_deserializer=_identity)

    def call(self, payload: bytes) -> bytes:
        return self._call(payload, timeout=10)

    def close(self) -> None:
        self._channel.close()


def main() -> None:
    runner = asyncio.run
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        pass
    runner(_serve(sys.argv[1]))


if __name__ == "__main__":
    main()
