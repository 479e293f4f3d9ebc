"""A small HTTP/1.1 JSON server on asyncio: the router's HTTP API without a web framework.

Handlers take the decoded JSON body (None for a GET) and return ``(status, object)``. A
malformed request (bad request line, no or too large Content-Length, a body that is not JSON)
gets a 4xx answer with ``{"error", "reason"}`` and the connection is closed; a handler that
raises an unexpected exception gets 500 and the server keeps serving. Keep-alive is honoured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("kvstored.router")

Handler = Callable[[Any], Awaitable[tuple[int, Any]]]
MAX_BODY = 64 << 20
MAX_HEADER_LINES = 100
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
           413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class JsonHttpServer:
    def __init__(self, routes: dict[tuple[str, str], Handler], read_timeout_s: float = 30.0) -> None:
        self._routes = routes
        self._timeout = read_timeout_s
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port (``port`` 0 picks a free one)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 16)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(self._timeout):
                        request = await self._read(reader)
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                except HttpError as exc:
                    await self._write(writer, exc.status, {"error": str(exc), "reason": "bad_request"}, False)
                    return
                if request is None:
                    return
                method, path, body, keep = request
                status, obj = await self._dispatch(method, path, body)
                await self._write(writer, status, obj, keep)
                if not keep:
                    return
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read(self, reader: asyncio.StreamReader) -> tuple[str, str, bytes, bool] | None:
        try:
            line = await reader.readline()
        except ValueError:
            raise HttpError(400, "request line too long") from None
        if not line:
            return None
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise HttpError(400, "malformed request line")
        method, path, version = parts
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADER_LINES):
            try:
                raw = await reader.readline()
            except ValueError:
                raise HttpError(400, "header line too long") from None
            if raw in (b"\r\n", b"\n", b""):
                break
            name, sep, value = raw.decode("latin-1").partition(":")
            if not sep:
                raise HttpError(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
        else:
            raise HttpError(400, "too many header lines")
        body = b""
        if "transfer-encoding" in headers:
            raise HttpError(411, "chunked bodies are not supported: send Content-Length")
        if "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise HttpError(400, "bad Content-Length") from None
            if length < 0:
                raise HttpError(400, "bad Content-Length")
            if length > MAX_BODY:
                raise HttpError(413, f"body of {length} bytes exceeds {MAX_BODY}")
            body = await reader.readexactly(length)
        elif method == "POST":
            raise HttpError(411, "POST needs Content-Length")
        keep = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        return method, path.split("?", 1)[0], body, keep

    async def _dispatch(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        handlers = {m: h for (m, p), h in self._routes.items() if p == path}
        if not handlers:
            return 404, {"error": f"no such path {path}", "reason": "not_found"}
        handler = handlers.get(method)
        if handler is None:
            return 405, {"error": f"{path} takes {', '.join(sorted(handlers))}", "reason": "method_not_allowed"}
        obj: Any = None
        if method == "POST":
            try:
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError) as exc:
                return 400, {"error": f"body is not JSON: {exc}", "reason": "invalid_argument"}
        try:
            return await handler(obj)
        except Exception:
            log.exception("router: %s %s failed", method, path)
            return 500, {"error": "internal error (logged)", "reason": "internal"}

    async def _write(self, writer: asyncio.StreamWriter, status: int, obj: Any, keep: bool) -> None:
        data = json.dumps(obj).encode()
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n")
        writer.write(head.encode() + data)
        await writer.drain()
