"""Network addresses in configuration: "host:port" parsing, and which hosts are loopback."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals; "" and wildcard addresses are not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_address(addr: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(addr, tuple):
        return addr
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)
