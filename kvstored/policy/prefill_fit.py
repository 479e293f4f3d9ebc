"""A node's prefill speed fitted from measured prefills: ``seconds = overhead + flops / rate``,
a least-squares line over the observations with older ones weighing less (each new one scales
the others by ``decay``), so a node that slows down (a hot GPU, a noisy neighbour) is followed.

Until two different sizes are seen the fit keeps its prior rate and only moves the overhead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillSpeed:
    flops_per_s: float
    overhead_s: float
    samples: int


class PrefillFit:
    """The running sums of one node's observations (weighted by recency)."""

    def __init__(self, prior_flops_per_s: float, decay: float = 0.98) -> None:
        if prior_flops_per_s <= 0 or not 0 < decay <= 1:
            raise ValueError("prior_flops_per_s must be positive and decay in (0, 1]")
        self._prior = prior_flops_per_s
        self._decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._samples = 0

    def observe(self, flops: float, seconds: float) -> None:
        """One prefill of ``flops`` that took ``seconds``; ignored unless both are positive."""
        if flops <= 0 or seconds <= 0:
            return
        d = self._decay
        x = flops / self._prior   # scaled: sums of squares of 1e15s lose precision
        self._w = self._w * d + 1
        self._x = self._x * d + x
        self._y = self._y * d + seconds
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * seconds
        self._samples += 1

    def speed(self) -> PrefillSpeed:
        """The fitted speed; the prior rate (overhead from the mean) with too little spread."""
        if self._w == 0:
            return PrefillSpeed(self._prior, 0.0, 0)
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 1e-12 * max(mx * mx, 1e-30):
            slope = (self._xy / self._w - mx * my) / var   # seconds per (flops / prior)
            overhead = my - slope * mx
            if slope > 0 and overhead >= 0:
                return PrefillSpeed(self._prior / slope, overhead, self._samples)
            if slope > 0:   # a negative intercept: a line through the origin instead
                return PrefillSpeed(self._prior * self._xx / self._xy, 0.0, self._samples)
        # one size only (or noise): the prior's rate if it explains the mean, else the mean's
        if my > mx:
            return PrefillSpeed(self._prior, my - mx, self._samples)
        return PrefillSpeed(self._prior * mx / my, 0.0, self._samples)
