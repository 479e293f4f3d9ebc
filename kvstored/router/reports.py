"""What each daemon's heartbeat reports: its tiers' read speeds and its namespaces' block sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TierSpeed:
    read_bytes_per_s: float
    read_latency_s: float = 0.0


class NodeReports:
    def __init__(self) -> None:
        self._tiers: dict[str, dict[str, TierSpeed]] = {}
        self._block_bytes: dict[int, int] = {}

    def heard(self, node: str, info: dict[str, Any]) -> None:
        """A heartbeat's info map; malformed parts are ignored (a report is advice)."""
        tiers = info.get("tiers")
        if isinstance(tiers, dict):
            speeds = {}
            for name, t in tiers.items():
                if isinstance(name, str) and isinstance(t, dict):
                    rate, latency = t.get("read_bytes_per_s"), t.get("read_latency_s", 0.0)
                    if isinstance(rate, (int, float)) and rate > 0 and isinstance(latency, (int, float)):
                        speeds[name] = TierSpeed(float(rate), max(0.0, float(latency)))
            self._tiers[node] = speeds
        namespaces = info.get("namespaces")
        if isinstance(namespaces, dict):
            for ns_id, ns in namespaces.items():
                if isinstance(ns_id, int) and isinstance(ns, dict) and isinstance(ns.get("block_bytes"), int) \
                        and ns["block_bytes"] > 0:
                    self._block_bytes[ns_id] = ns["block_bytes"]

    def tier(self, node: str, name: str) -> TierSpeed | None:
        return self._tiers.get(node, {}).get(name)

    def block_bytes(self, namespace_id: int) -> int:
        """The namespace's KV bytes per block as some daemon reported it (0: unknown)."""
        return self._block_bytes.get(namespace_id, 0)
