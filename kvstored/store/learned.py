"""What the tiers' policies have learned (a scale, weights), as the SSD tier keeps it across restarts."""

from __future__ import annotations

import json
import logging
import math

from kvstored.store.placement import Placement

log = logging.getLogger("kvstored.store")

SSD_POLICY = "ssd"
DRAM_POLICY = "dram/"   # + the slot size in bytes: one DRAM policy per slot size


def learned_records(placement: Placement) -> dict[str, bytes]:
    """Each policy's :meth:`~kvstored.policy.interface.BlockPolicy.learned` state and the policy's
    name, by tier, encoded for :meth:`~kvstored.tiers.ssd.SSDTier.put_learned` (policies that
    learn nothing left out)."""
    policies = {SSD_POLICY: placement.ssd.policy}
    policies.update({f"{DRAM_POLICY}{size}": policy for size, policy in placement.dram.policies().items()})
    return {name: json.dumps({"policy": policy.name, "state": state}, sort_keys=True).encode()
            for name, policy in policies.items() if (state := policy.learned())}


def resume_learned(placement: Placement, records: dict[str, bytes]) -> int:
    """Start each tier's policy from what :func:`learned_records` kept (before the restored blocks
    enter it); records that do not decode, or name no tier of this daemon, are skipped with a
    warning, those another policy learned (the tier's policy changed since) with a note. Returns
    how many policies resumed."""
    resumed = 0
    for name, raw in records.items():
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("policy"), str):
                raise ValueError("no policy named")
            state = record.get("state")
            if not isinstance(state, dict) or not all(_number(v) for v in state.values()):
                raise ValueError("not a mapping of names to numbers")
            if name == SSD_POLICY:
                policy = placement.ssd.policy
            elif name.startswith(DRAM_POLICY) and name[len(DRAM_POLICY):].isdigit() \
                    and int(name[len(DRAM_POLICY):]) > 0:
                policy = placement.dram.policy_of_size(int(name[len(DRAM_POLICY):]))
            else:
                raise ValueError("no such tier")
        except ValueError as exc:   # (json's errors are ValueErrors too)
            log.warning("not resuming the policy recorded as %r: %s", name, exc)
            continue
        if record["policy"] != policy.name:
            log.info("not resuming the %s policy of %r from what %s learned", policy.name, name, record["policy"])
            continue
        policy.resume(state)
        resumed += 1
    return resumed


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
