"""The shapes by name, their mixture, and ``generate``: a shape's requests as trace records."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tools.workloads.arrivals import Request, arrivals
from tools.workloads.blocks import BlockIds, prompt_tokens
from tools.workloads.draw import Labels
from tools.workloads.shapes import Agent, Chat, DocQA, FewShot, Scan, Shape

SINGLE_SHAPES: dict[str, type[Any]] = {"chat": Chat, "docqa": DocQA, "agent": Agent, "fewshot": FewShot, "scan": Scan}
DEFAULT_WEIGHTS = {"chat": 0.4, "docqa": 0.25, "agent": 0.2, "fewshot": 0.1, "scan": 0.05}


@dataclass(frozen=True)
class Mix:
    """A weighted mixture of the single shapes, interleaved in time.

    ``weights`` (chat 0.4, docqa 0.25, agent 0.2, fewshot 0.1, scan 0.05) are shares of the
    requests. Each component keeps its parameters (the fields ``chat``, ``docqa``, ``agent``,
    ``fewshot``, ``scan``: each shape's defaults unless given, as ``docqa.documents=1000``) and its
    sessions' timing, but its session rate is fitted (``fit_rate``) so that every component's
    requests span the same time: ``duration_s`` when given, else the time their shares take at
    their own rates one after another (about the weighted harmonic mean of their request rates).
    """

    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    chat: Chat = field(default_factory=Chat)
    docqa: DocQA = field(default_factory=DocQA)
    agent: Agent = field(default_factory=Agent)
    fewshot: FewShot = field(default_factory=FewShot)
    scan: Scan = field(default_factory=Scan)

    def __post_init__(self) -> None:
        unknown = set(self.weights) - set(SINGLE_SHAPES)
        if unknown:
            raise ValueError(f"mix: unknown shapes in weights: {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(SINGLE_SHAPES)}")
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError("mix: weights must be >= 0 with a positive sum")

    def shares(self, n: int) -> dict[str, int]:
        """``n`` requests split by weight (largest remainders get the leftovers)."""
        total = sum(self.weights.values())
        exact = {name: n * w / total for name, w in self.weights.items()}
        counts = {name: int(x) for name, x in exact.items()}
        by_remainder = sorted(exact, key=lambda name: counts[name] - exact[name])
        for name in by_remainder[: n - sum(counts.values())]:
            counts[name] += 1
        return counts


SHAPES: dict[str, type[Any]] = {**SINGLE_SHAPES, "mix": Mix}


def make_shape(name: str, params: Mapping[str, Any] | None = None) -> Shape | Mix:
    """Shape ``name`` with ``params`` over its defaults; a mix takes ``component.param`` keys too."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    cls = SHAPES[name]
    plain: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in (params or {}).items():
        component, dot, sub = key.partition(".")
        if dot:
            if cls is not Mix or component not in SINGLE_SHAPES:
                raise ValueError(f"{name}: unknown parameter {key!r}")
            nested.setdefault(component, {})[sub] = value
        else:
            plain[key] = value
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in plain if key not in names]
    if unknown:
        raise ValueError(f"{name}: unknown parameter {unknown[0]!r}; it takes {', '.join(names)}")
    for component in set(nested) | {k for k, v in plain.items() if isinstance(v, Mapping) and k in SINGLE_SHAPES}:
        base = plain.get(component)
        given = ({f.name: getattr(base, f.name) for f in dataclasses.fields(base)} if dataclasses.is_dataclass(base)
                 else dict(base or {}))
        plain[component] = make_shape(component, {**given, **nested.get(component, {})})
    shape: Shape | Mix = cls(**plain)
    return shape


def draw_requests(shape: Shape | Mix, seed: int | str, labels: Labels, n: int,
                  duration_s: float | None = None) -> list[Request]:
    """The first ``n`` requests of ``shape`` by arrival, drawn from ``seed``; with ``duration_s``,
    its sessions start at the rate that puts the last of them about that long after the first."""
    if n < 0 or (duration_s is not None and duration_s <= 0):
        raise ValueError("requests must be >= 0 and a duration positive")
    if n == 0:
        return []
    if not isinstance(shape, Mix):
        rate = shape.rate if duration_s is None else fit_rate(shape, seed, n, duration_s)
        rng = random.Random(seed)
        return arrivals(rng, shape.sessions(rng, labels), rate, n)
    counts = {name: count for name, count in shape.shares(n).items() if count}
    parts: dict[str, Shape] = {name: getattr(shape, name) for name in counts}
    # unless given, the time the shares take at their own rates one after another
    span = duration_s or sum((count / parts[name].rate + parts[name].mean_lag_s() * count / n)
                             / parts[name].mean_requests() for name, count in counts.items())
    merged: list[Request] = []
    for name, part in parts.items():
        # each component its own stream, so that one's draws do not shift another's
        sub = f"{seed}:{name}"
        rate = fit_rate(part, sub, counts[name], span) if len(parts) > 1 or duration_s else part.rate
        rng = random.Random(sub)
        merged += arrivals(rng, part.sessions(rng, labels), rate, counts[name])
    merged.sort(key=lambda r: r.time)
    return merged


def fit_rate(shape: Shape, seed: int | str, n: int, duration_s: float, tolerance: float = 0.01) -> float:
    """The rate of session starts at which the ``n``-th request of ``shape`` drawn from ``seed``
    comes ``duration_s`` after the first (within ``tolerance``, or as near as 8 tries get).

    The same seed draws the same sessions at any rate, their starts scaled by 1 / rate, so the
    span is ``a / rate`` plus the later turns' delays: scaling the rate by span / duration
    converges, at once for one-shot shapes. The first guess counts sessions starting at rate r
    as bringing r * (mean_requests * D - mean_lag_s) requests before D."""
    expected = shape.mean_requests() * duration_s
    rate = n / max(expected - shape.mean_lag_s(), expected / 4)
    for _ in range(8):
        rng = random.Random(seed)
        drawn = arrivals(rng, shape.sessions(rng, Labels()), rate, n)
        span = drawn[-1].time - drawn[0].time
        if span <= 0 or abs(span / duration_s - 1) <= tolerance:
            break
        rate *= span / duration_s
    return rate


def to_records(requests: list[Request], block_tokens: int = 512) -> list[dict[str, Any]]:
    """Requests, in arrival order, as records of the conversation trace: the first at 0 ms."""
    ids = BlockIds(block_tokens)
    t0 = requests[0].time if requests else 0.0
    return [{"timestamp": round((r.time - t0) * 1000), "input_length": prompt_tokens(r.prompt),
             "output_length": r.output, "hash_ids": ids.chain(r.prompt)} for r in requests]


def generate(shape: str, requests: int, seed: int, *, duration_s: float | None = None, block_tokens: int = 512,
             **params: Any) -> list[dict[str, Any]]:
    """``requests`` records of ``shape`` (a name of SHAPES) with ``params`` over its defaults, the
    same for the same arguments: ``{"timestamp": ms, "input_length": tokens, "output_length":
    tokens, "hash_ids": [...]}``, ``ceil(input_length / block_tokens)`` chained ids each."""
    config = make_shape(shape, params)
    return to_records(draw_requests(config, seed, Labels(), requests, duration_s), block_tokens)
