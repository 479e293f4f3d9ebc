"""The peer block channel's expected failures."""

from __future__ import annotations


class PeerError(Exception):
    """Base of the channel's expected failures."""


class PeerConfigError(PeerError, ValueError):
    """The channel's configuration is unusable (unsafe listener, unreadable certificate, ...)."""


class PeerRefused(PeerError):
    """The peer answered, with an error: it is up and in step, but would not do what was asked
    (an unknown or refused namespace, a question it cannot take)."""


class PeerAuthError(PeerError):
    """The peer refused our credentials, or we refused the peer's; the message says which and why."""
