"""Prefill speed per node, fitted from the prefills its engine measured (the cost model's FLOPs
over a fitted rate, :mod:`kvstored.policy.prefill_fit`)."""

from __future__ import annotations

from kvstored.policy.cost import ModelShape, prefix_prefill_flops
from kvstored.policy.prefill_fit import PrefillFit, PrefillSpeed


class Calibration:
    def __init__(self, prior_flops_per_s: float, prior_overhead_s: float = 0.0) -> None:
        self._prior = prior_flops_per_s
        self._prior_overhead = prior_overhead_s
        self._fits: dict[str, PrefillFit] = {}

    def observe(self, node: str, shape: ModelShape, tokens: int, cached_tokens: int, seconds: float) -> None:
        """``node`` prefilled tokens ``cached_tokens .. tokens`` of a prompt in ``seconds``."""
        if not 0 <= cached_tokens < tokens:
            return
        flops = prefix_prefill_flops(shape, tokens, 1) - prefix_prefill_flops(shape, cached_tokens, 1)
        self._fits.setdefault(node, PrefillFit(self._prior)).observe(flops, seconds)

    def speed(self, node: str) -> PrefillSpeed:
        fit = self._fits.get(node)
        return fit.speed() if fit is not None else PrefillSpeed(self._prior, self._prior_overhead, 0)
