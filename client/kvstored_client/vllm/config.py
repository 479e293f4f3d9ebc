"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` (a dict of JSON values).

Pure: no vLLM, no daemon. Unknown keys and values of the wrong type are refused with the key named,
so a typo in an engine's command line fails at start-up instead of silently disabling the cache.
vLLM's ``kv_role`` sets what an engine does: ``kv_producer`` stores and never loads,
``kv_consumer`` loads and stores only if told to (``save: true``), ``kv_both`` does both; settings
that contradict the role are refused with the reason.
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
    prompt a prefill engine stored on another node); fetched blocks stay on this node.
    ``max_wait_s`` and ``prefill_tokens_per_s`` (``kv_consumer`` with ``peers``): the decode
    engine's wait rule (``arrival.py``): how long a request may wait at most for its prompt's
    blocks to arrive from a peer, and the engine's prefill rate that waiting is weighed against
    (0: measured from the engine's own steps, :data:`PREFILL_PRIOR` until then).
    ``role``: vLLM's ``kv_role``, not a key of the extra config."""

    socket: str = ""
    load: bool = True
    save: bool = True
    model: str = ""
    timeout_s: float = 5.0
    push_to: str = ""
    zero_copy: bool = True
    layerwise: bool = True
    peers: bool = False
    max_wait_s: float = 2.0
    prefill_tokens_per_s: float = 0.0
    role: str = "kv_both"

    @property
    def waits_for_arrivals(self) -> bool:
        """A decode engine that fetches prompts from peers waits for them by the wait rule."""
        return self.role == "kv_consumer" and self.peers and self.load

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, role: str = "kv_both") -> ConnectorConfig:
        """The settings from ``kv_connector_extra_config`` for vLLM's ``kv_role``; ValueError
        naming a bad key, or saying which setting contradicts the role."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls) if f.name != "role"}
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
        return cls(**{**values, **_role_defaults(role, values)})


ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The prefill rate a consumer assumes until it has measured its own (tokens a second).
PREFILL_PRIOR = 10_000.0
_WAIT_KEYS = ("max_wait_s", "prefill_tokens_per_s")


def _role_defaults(role: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """What ``kv_role`` sets beyond the keys ``given``; ValueError on a contradiction."""
    if role not in ROLES:
        raise ValueError(f"kvstored connector: kv_role {role!r} is not one of {list(ROLES)}")
    out: dict[str, Any] = {"role": role}
    waits = [k for k in _WAIT_KEYS if k in given]
    if role == "kv_producer":
        if given.get("load") is True:
            raise ValueError("kvstored connector: kv_role='kv_producer' never loads; load: true contradicts it "
                             "(use kv_role='kv_both')")
        out["load"] = False
    elif role == "kv_consumer":
        if given.get("load") is False:
            raise ValueError("kvstored connector: kv_role='kv_consumer' loads; load: false contradicts it")
        out["save"] = given.get("save", False)   # a decode engine stores only if told to
        if given.get("push_to") and not out["save"]:
            raise ValueError("kvstored connector: push_to pushes what the engine saves, and a kv_role='kv_consumer' "
                             "saves only with save: true")
        if waits and not given.get("peers"):
            raise ValueError(f"kvstored connector: {waits} rule the wait for blocks fetched from peers; they need "
                             "peers: true")
    if waits and role != "kv_consumer":
        raise ValueError(f"kvstored connector: {waits} apply to kv_role='kv_consumer' only, not {role!r}")
    return out
