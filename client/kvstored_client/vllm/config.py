"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` (a dict of JSON values).

Pure: no vLLM, no daemon. Unknown keys and values of the wrong type are refused with the key named,
so a typo in an engine's command line fails at start-up instead of silently disabling the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``socket``: the daemon's socket ("" for the SDK's default: ``$KVSTORED_SOCKET`` or the
    system one). ``load``/``save``: take prefixes from kvstored / store computed prompt blocks.
    ``model``: the namespace's model name ("" for vLLM's model). ``timeout_s``: the longest one
    call to the daemon may take before the engine gives up on it and recomputes.
    ``push_to``: a peer node id the daemon pushes every saved chunk to (prefill/decode).
    ``zero_copy``: allocate vLLM's (CPU) KV cache in shared memory and register it with the daemon,
    which then copies blocks itself (else the engine copies them through the SDK's arena calls).
    ``layerwise``: with zero copy, let each attention layer start as soon as its own layer of the
    cached prefix is in place instead of waiting for all of them.
    ``peers``: also find and fetch blocks that peer daemons hold (a decode engine taking the
    prompt a prefill engine stored on another node); fetched blocks stay on this node."""

    socket: str = ""
    load: bool = True
    save: bool = True
    model: str = ""
    timeout_s: float = 5.0
    push_to: str = ""
    zero_copy: bool = True
    layerwise: bool = True
    peers: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """The settings from ``kv_connector_extra_config``; ValueError naming a bad key."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kvstored connector: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = known[name].default
            if isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
                value = float(value) if ok else value
            else:
                ok = isinstance(value, str)
            if not ok:
                raise ValueError(f"kvstored connector: kv_connector_extra_config[{name!r}] = {value!r} is not "
                                 f"a {'positive number' if isinstance(default, float) else type(default).__name__}")
            values[name] = value
        return cls(**values)
