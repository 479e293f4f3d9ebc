"""Admission to the SSD tier: should a block leaving DRAM be written down, or dropped?"""

from __future__ import annotations

from kvstored_client.contract.namespace import Namespace


def admit(mode: str, depth: int, hit_before: bool, spec: Namespace) -> bool:
    """Decide by ``ssd.admission``: always, never, only blocks hit since they were stored, or by
    cost (recomputing the block must cost more than reading it back; see policy.cost)."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    if mode == "hit_before":
        return hit_before
    if mode == "cost":
        from kvstored.policy.cost import admit_block

        return admit_block(spec, depth)
    raise AssertionError(f"unknown admission mode {mode!r}")
