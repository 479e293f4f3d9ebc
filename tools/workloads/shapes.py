"""The single workload shapes: each a frozen dataclass of named parameters with defaults.

A shape's ``rate`` is how many sessions start per second (a Poisson process; a session of the
one-shot shapes is one request), ``mean_requests()`` the expected requests per session,
``mean_lag_s()`` the expected sum of their delays after the session's start, and
``sessions(rng, labels)`` draws what is shared across the trace (system prompts, documents,
templates) and returns the function that draws one session from its start time. Token counts
named ``*_tokens`` are medians of log-normal draws whose log-space spread is the matching
``*_sigma``; times are in seconds. Every request's output length is drawn the same way
(``output_tokens``, ``output_sigma``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

from tools.workloads.arrivals import Request, Sessions
from tools.workloads.blocks import Segment, prompt_tokens
from tools.workloads.draw import Labels, Zipf, geometric, lognormal, lognormal_s

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class Shape(Protocol):
    @property
    def rate(self) -> float: ...

    def mean_requests(self) -> float: ...

    def mean_lag_s(self) -> float: ...

    def sessions(self, rng: random.Random, labels: Labels) -> Sessions: ...


def _check(shape: DataclassInstance) -> None:
    """Counts, rates and medians are positive; spreads, Zipf exponents, drift and chances >= 0."""
    for f in fields(shape):
        value = getattr(shape, f.name)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        zero_ok = f.name.endswith(("sigma", "zipf", "drift_s", "drift_shift", "continue_first", "continue_max"))
        if value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"{type(shape).__name__.lower()}: {f.name} must be "
                             f"{'>= 0' if zero_ok else 'positive'}, got {value}")


class _OneShot:
    """A session of one request, at its start."""

    def mean_requests(self) -> float:
        return 1.0

    def mean_lag_s(self) -> float:
        return 0.0


@dataclass(frozen=True)
class Chat:
    """Multi-turn chat, after the conversation trace (its figures in brackets).

    Sessions start at ``rate`` per second (2.3). Turn 1 is one of ``system_prompts`` (4) shared
    system prompts (``system_tokens`` 700, sigma 0.3; picked by Zipf(``system_zipf`` 1.0)) and a
    first user message (``first_tokens`` 4,500, ``first_sigma`` 1.3: first prompts of 5.2k tokens
    [5.2k]). Each later turn is the previous prompt, its reply (that request's output) and a new
    user message (``user_tokens`` 200, ``user_sigma`` 1.0), ``gap_s`` (120, ``gap_sigma`` 1.0: a
    median of 2 minutes [126 s, sigma 0.98]) after the previous turn. After turn k another follows
    with probability ``continue_max - (continue_max - continue_first) * exp(-(k - 1) /
    continue_turns)`` (0.85, 0.25, 4: 0.25, 0.38, 0.49, 0.57 ... [0.25, 0.39, 0.49, 0.55]), up to
    ``max_turns`` (64) turns while the prompt stays within ``max_prompt_tokens`` (131,072).
    Outputs: ``output_tokens`` 350 [median 350], ``output_sigma`` 0.7. About 1.5 requests per
    session [1.5], 3.4 requests/s [3.4]; prompts of 6.0k tokens [6.9k]; an infinite cache serves
    34% of the full blocks [38%].
    """

    rate: float = 2.3
    system_prompts: int = 4
    system_tokens: int = 700
    system_zipf: float = 1.0
    first_tokens: int = 4500
    first_sigma: float = 1.3
    user_tokens: int = 200
    user_sigma: float = 1.0
    gap_s: float = 120.0
    gap_sigma: float = 1.0
    continue_first: float = 0.25
    continue_max: float = 0.85
    continue_turns: float = 4.0
    max_turns: int = 64
    max_prompt_tokens: int = 131072
    output_tokens: int = 350
    output_sigma: float = 0.7

    def __post_init__(self) -> None:
        _check(self)
        if not 0 <= self.continue_first <= 1 or not 0 <= self.continue_max <= 1:
            raise ValueError("chat: continue_first and continue_max are probabilities")

    def continue_p(self, turn: int) -> float:
        """The probability that turn ``turn`` (1 for the first) is followed by another."""
        rise = math.exp(-(turn - 1) / self.continue_turns)
        return self.continue_max - (self.continue_max - self.continue_first) * rise

    def _reach(self) -> list[float]:
        """The probability that a session gets to turn 1, 2, ... (the prompt cap left aside)."""
        reach = [1.0]
        for turn in range(1, self.max_turns):
            reach.append(reach[-1] * self.continue_p(turn))
        return reach

    def mean_requests(self) -> float:
        return sum(self._reach())

    def mean_lag_s(self) -> float:
        mean_gap = self.gap_s * math.exp(self.gap_sigma ** 2 / 2)
        return sum(p * k * mean_gap for k, p in enumerate(self._reach()))

    def sessions(self, rng: random.Random, labels: Labels) -> Sessions:
        systems = [(labels.new(), lognormal(rng, self.system_tokens, 0.3)) for _ in range(self.system_prompts)]
        pick = Zipf(self.system_prompts, self.system_zipf)

        def session(start: float) -> list[Request]:
            system = systems[pick.draw(rng)]
            room = max(1, self.max_prompt_tokens - system[1])
            prompt: tuple[Segment, ...] = (system, (labels.new(), lognormal(rng, self.first_tokens,
                                                                             self.first_sigma, high=room)))
            t = start
            out: list[Request] = []
            for turn in range(1, self.max_turns + 1):
                reply = lognormal(rng, self.output_tokens, self.output_sigma)
                out.append(Request(t, prompt, reply))
                if rng.random() >= self.continue_p(turn):
                    break
                message = lognormal(rng, self.user_tokens, self.user_sigma)
                following = (*prompt, (labels.new(), reply), (labels.new(), message))
                if prompt_tokens(following) > self.max_prompt_tokens:
                    break
                prompt = following
                t += lognormal_s(rng, self.gap_s, self.gap_sigma)
            return out

        return session


@dataclass(frozen=True)
class DocQA(_OneShot):
    """Long-document QA and RAG: the same documents asked about again, minutes apart.

    Requests arrive at ``rate`` per second (1.0). Each is a shared system prompt
    (``system_tokens`` 300), ``docs_per_request`` (1; more for RAG, distinct, in the order drawn)
    documents of a corpus of ``documents`` (5,000; ``doc_tokens`` 11,000, ``doc_sigma`` 0.6, at
    most ``max_doc_tokens`` 100,000) and a question (``question_tokens`` 60, ``question_sigma``
    0.6); answers ``output_tokens`` 200, ``output_sigma`` 0.6. Documents are drawn by popularity
    rank, Zipf(``zipf`` 1.0): the 10 most popular take a third of the requests. Popularity
    drifts: every ``drift_s`` (300 s; 0 for never) the ranking rotates by ``drift_shift`` (50)
    documents, so the hottest ones fall to the cold end and the next ones rise. With the
    defaults, prompts of ~11.3k tokens; over 10,000 requests a document asked about again was
    last asked about a median of ~1.5 minutes before (a quarter over 10 minutes).
    """

    rate: float = 1.0
    documents: int = 5000
    doc_tokens: int = 11000
    doc_sigma: float = 0.6
    max_doc_tokens: int = 100_000
    docs_per_request: int = 1
    zipf: float = 1.0
    drift_s: float = 300.0
    drift_shift: int = 50
    system_tokens: int = 300
    question_tokens: int = 60
    question_sigma: float = 0.6
    output_tokens: int = 200
    output_sigma: float = 0.6

    def __post_init__(self) -> None:
        _check(self)
        if self.docs_per_request > self.documents:
            raise ValueError("docqa: docs_per_request is more than the documents there are")

    def sessions(self, rng: random.Random, labels: Labels) -> Sessions:
        system = (labels.new(), self.system_tokens)
        docs = [(labels.new(), lognormal(rng, self.doc_tokens, self.doc_sigma, high=self.max_doc_tokens))
                for _ in range(self.documents)]
        by_rank = list(range(self.documents))
        rng.shuffle(by_rank)
        popularity = Zipf(self.documents, self.zipf)

        def document(start: float) -> Segment:
            epoch = int(start // self.drift_s) if self.drift_s > 0 else 0
            return docs[by_rank[(popularity.draw(rng) + epoch * self.drift_shift) % self.documents]]

        def session(start: float) -> list[Request]:
            chosen: list[Segment] = []
            while len(chosen) < self.docs_per_request:
                doc = document(start)
                if doc not in chosen:
                    chosen.append(doc)
            question = (labels.new(), lognormal(rng, self.question_tokens, self.question_sigma))
            output = lognormal(rng, self.output_tokens, self.output_sigma)
            return [Request(start, (system, *chosen, question), output)]

        return session


@dataclass(frozen=True)
class Agent:
    """Agent and tool loops: a long fixed prefix, then many turns seconds apart.

    Sessions start at ``rate`` per second (0.25). Each runs one of ``agents`` (8, picked by
    Zipf(``agent_zipf`` 1.0)), whose prefix (system prompt and tool descriptions: ``prefix_tokens``
    6,000, ``prefix_sigma`` 0.2, so ~4-8k) is followed by a task (``task_tokens`` 300,
    ``task_sigma`` 0.8). A session has a geometric number of turns (mean ``turns`` 15); a turn's
    output is a tool call (``output_tokens`` 120, ``output_sigma`` 0.6), and the next turn's prompt
    is the previous one plus that call and the tool's result (``result_tokens`` 600,
    ``result_sigma`` 1.0), ``gap_s`` (3 s, ``gap_sigma`` 0.7) later, while it stays within
    ``max_prompt_tokens`` (131,072). About 3.75 requests/s.
    """

    rate: float = 0.25
    agents: int = 8
    agent_zipf: float = 1.0
    prefix_tokens: int = 6000
    prefix_sigma: float = 0.2
    task_tokens: int = 300
    task_sigma: float = 0.8
    turns: float = 15.0
    result_tokens: int = 600
    result_sigma: float = 1.0
    gap_s: float = 3.0
    gap_sigma: float = 0.7
    max_prompt_tokens: int = 131072
    output_tokens: int = 120
    output_sigma: float = 0.6

    def __post_init__(self) -> None:
        _check(self)

    def mean_requests(self) -> float:
        return max(1.0, self.turns)

    def mean_lag_s(self) -> float:
        # turn k (from 0) comes k mean gaps in; geometric turns T: E[T (T - 1) / 2] = (1 - p) / p^2
        p = 1.0 / max(1.0, self.turns)
        return (1.0 - p) / p ** 2 * self.gap_s * math.exp(self.gap_sigma ** 2 / 2)

    def sessions(self, rng: random.Random, labels: Labels) -> Sessions:
        prefixes = [(labels.new(), lognormal(rng, self.prefix_tokens, self.prefix_sigma)) for _ in range(self.agents)]
        pick = Zipf(self.agents, self.agent_zipf)

        def session(start: float) -> list[Request]:
            prompt: tuple[Segment, ...] = (prefixes[pick.draw(rng)],
                                           (labels.new(), lognormal(rng, self.task_tokens, self.task_sigma)))
            t = start
            out: list[Request] = []
            for _ in range(geometric(rng, self.turns)):
                call = lognormal(rng, self.output_tokens, self.output_sigma)
                out.append(Request(t, prompt, call))
                result = lognormal(rng, self.result_tokens, self.result_sigma)
                following = (*prompt, (labels.new(), call), (labels.new(), result))
                if prompt_tokens(following) > self.max_prompt_tokens:
                    break
                prompt = following
                t += lognormal_s(rng, self.gap_s, self.gap_sigma)
            return out

        return session


@dataclass(frozen=True)
class FewShot(_OneShot):
    """Few-shot prompting: a few short shared templates, each request its own suffix.

    Requests arrive at ``rate`` per second (4.0). Each is one of ``templates`` (6, picked by
    Zipf(``template_zipf`` 1.0); ``template_tokens`` 1,500, ``template_sigma`` 0.2, so ~1-2k) and a
    suffix never seen before (``suffix_tokens`` 150, ``suffix_sigma`` 0.8); outputs
    ``output_tokens`` 60, ``output_sigma`` 0.8. Only a template's full blocks are ever reused.
    """

    rate: float = 4.0
    templates: int = 6
    template_zipf: float = 1.0
    template_tokens: int = 1500
    template_sigma: float = 0.2
    suffix_tokens: int = 150
    suffix_sigma: float = 0.8
    output_tokens: int = 60
    output_sigma: float = 0.8

    def __post_init__(self) -> None:
        _check(self)

    def sessions(self, rng: random.Random, labels: Labels) -> Sessions:
        templates = [(labels.new(), lognormal(rng, self.template_tokens, self.template_sigma))
                     for _ in range(self.templates)]
        pick = Zipf(self.templates, self.template_zipf)

        def session(start: float) -> list[Request]:
            suffix = (labels.new(), lognormal(rng, self.suffix_tokens, self.suffix_sigma))
            output = lognormal(rng, self.output_tokens, self.output_sigma)
            return [Request(start, (templates[pick.draw(rng)], suffix), output)]

        return session


@dataclass(frozen=True)
class Scan(_OneShot):
    """One-shot requests that share nothing, not even a system prompt: no block is ever reused.

    Requests arrive at ``rate`` per second (2.0); prompts ``prompt_tokens`` 3,000,
    ``prompt_sigma`` 1.0, at most ``max_prompt_tokens`` 131,072; outputs ``output_tokens`` 300,
    ``output_sigma`` 0.8.
    """

    rate: float = 2.0
    prompt_tokens: int = 3000
    prompt_sigma: float = 1.0
    max_prompt_tokens: int = 131072
    output_tokens: int = 300
    output_sigma: float = 0.8

    def __post_init__(self) -> None:
        _check(self)

    def sessions(self, rng: random.Random, labels: Labels) -> Sessions:
        def session(start: float) -> list[Request]:
            prompt = (labels.new(), lognormal(rng, self.prompt_tokens, self.prompt_sigma, high=self.max_prompt_tokens))
            return [Request(start, (prompt,), lognormal(rng, self.output_tokens, self.output_sigma))]

        return session
