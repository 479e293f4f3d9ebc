"""Replay a request trace through the real prefix index and the eviction policies.

    python -m tools.trace_replay [--trace PATH | --shape SHAPE [--requests N] [--seed S] [--param KEY=VALUE ...]]
                                 [--capacities 2,5,10,25,50] [--policies lru,lfu,credit] [--limit N]

Each request looks up the longest run of its leading blocks that is resident (a hit), then stores
its missing blocks in order behind that prefix, evicting what the policy picks; its own blocks are
pinned meanwhile, as a store reservation pins them. Only full blocks are cacheable: a partial last
block is never reused by a longer prompt (its hash changes once it fills), and in the conversation
trace no partial block's id ever appears again. Capacities are percentages of the trace's unique
full blocks. For each capacity and policy the table gives hit tokens and the prefill FLOPs the
hits save (Llama-3-8B shape, ``kvstored.policy.cost``), against two references:

- per-block LRU, as LMCache and Mooncake evict: one recency list of blocks, blind to the tree
  (evicting an interior block strands its descendants, which still take space until they age out);
- the offline bound, Belady-style and prefix-aware: the resident leaf whose next use is farthest
  in the future is evicted, and a block is not stored when its next use is farther than that. It
  bounds hit tokens; on saved FLOPs it is a reference, not a bound (it ignores that deeper blocks
  save more, and on small traces a policy can save slightly more FLOPs with the same hits).

The policies see the trace's timestamps as their clock. ``--shape`` replays a synthetic trace of
that shape instead (``tools.workloads``, generated in-process with 512-token blocks; ``--param``
sets one of the shape's parameters), the same records ``python -m tools.workloads`` would write.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstored.index import Block, PrefixIndex
from kvstored.policy.cost import ModelShape, prefix_prefill_flops
from kvstored.policy.interface import BlockPolicy
from kvstored.policy.leafheap import LeafHeap
from kvstored.policy.one_tier import store_chain
from kvstored.policy.registry import DEFAULT_POLICY, POLICIES, make_policy
from tools.workloads import SHAPES, generate
from tools.workloads.cli import shape_params

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512
PER_BLOCK_LRU = "per-block LRU"
OFFLINE_BOUND = "offline bound"
INF = float("inf")


@dataclass(frozen=True, slots=True)
class Trace:
    chains: list[list[bytes]]  # per request: keys of its full blocks, root first
    times: list[float]         # per request: arrival, seconds
    unique_blocks: int


def load_trace(path: Path, limit: int | None = None) -> Trace:
    """The first ``limit`` requests (all when None) as chains of 8-byte keys of full blocks."""
    with path.open() as f:
        return trace_from_records((json.loads(line) for line in f if line.strip()), limit)


def trace_from_records(records: Iterable[Mapping[str, Any]], limit: int | None = None) -> Trace:
    """Records of the conversation trace's format (as ``tools.workloads.generate`` returns) as a
    :class:`Trace`: the first ``limit`` of them, all when None."""
    chains: list[list[bytes]] = []
    times: list[float] = []
    for req in records:
        if limit is not None and len(chains) >= limit:
            break
        full = int(req["input_length"]) // BLOCK_TOKENS
        chains.append([int(h).to_bytes(8, "big") for h in req["hash_ids"][:full]])
        times.append(float(req["timestamp"]) / 1000.0)
    unique = len({k for chain in chains for k in chain})
    return Trace(chains, times, unique)


@dataclass(frozen=True, slots=True)
class Result:
    hit_tokens: int
    saved_flops: float


class Savings:
    """Hit tokens and saved prefill FLOPs, with the FLOPs of each prefix length memoised."""

    def __init__(self, shape: ModelShape) -> None:
        self._shape = shape
        self._flops: list[float] = []
        self.hit_blocks = 0
        self.saved = 0.0

    def add(self, blocks: int) -> None:
        while len(self._flops) <= blocks:
            self._flops.append(prefix_prefill_flops(self._shape, len(self._flops), BLOCK_TOKENS))
        self.hit_blocks += blocks
        self.saved += self._flops[blocks]

    def result(self) -> Result:
        return Result(self.hit_blocks * BLOCK_TOKENS, self.saved)


def replay(trace: Trace, policy: BlockPolicy, capacity: int, shape: ModelShape,
           set_clock: Callable[[float], None] = lambda t: None,
           on_request: Callable[[int], None] = lambda i: None) -> Result:
    """Run ``trace`` through a fresh :class:`PrefixIndex` of ``capacity`` blocks under ``policy``."""
    index = PrefixIndex(1)
    savings = Savings(shape)
    for i, chain in enumerate(trace.chains):
        set_clock(trace.times[i])
        on_request(i)
        hits = index.match(chain)
        savings.add(len(hits))
        if hits:
            policy.hit(hits)
        store_chain(index, policy, chain, hits, capacity)
    return savings.result()


def replay_per_block_lru(trace: Trace, capacity: int, shape: ModelShape) -> Result:
    """Per-block LRU: every block of a request is touched (or stored) in order; the least recent
    block goes, whether or not other resident blocks hang below it."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    savings = Savings(shape)
    for chain in trace.chains:
        hits = 0
        while hits < len(chain) and chain[hits] in lru:
            hits += 1
        savings.add(hits)
        for key in chain:
            if key in lru:
                lru.move_to_end(key)
                continue
            if len(lru) >= capacity:
                lru.popitem(last=False)
            lru[key] = None
    return savings.result()


class OfflineBound:
    """Prefix-aware Belady: evict the resident leaf used farthest in the future; refuse a block
    whose next use is farther than the victim's. Needs the whole trace; replay only."""

    name = OFFLINE_BOUND

    def __init__(self, trace: Trace) -> None:
        uses: dict[bytes, list[int]] = {}
        for i, chain in enumerate(trace.chains):
            for key in chain:
                uses.setdefault(key, []).append(i)
        self._uses = uses
        self._now = 0
        self._heap = LeafHeap()

    def begin(self, request: int) -> None:
        self._now = request

    def _next_use(self, key: bytes) -> float:
        u = self._uses.get(key, [])
        j = bisect.bisect_right(u, self._now)
        return float(u[j]) if j < len(u) else INF

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block: object) -> bool:
        return block in self._heap

    def admit(self, key: bytes, full: bool) -> bool:
        if not full:
            return True
        victim = self._heap.peek()
        return victim is None or self._next_use(key) < self._next_use(victim.key)

    def inserted(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        self.hit(blocks)

    def reuses(self, block: Block) -> int | None:
        return None   # it ranks by the future, not by the past

    def pending_hits(self, block: Block) -> int:
        return 0

    def hit(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            self._heap.set(block, (-self._next_use(block.key), 0.0))

    def removed(self, block: Block, moved: bool = False) -> None:
        self._heap.discard(block)

    def victim(self) -> Block | None:
        return self._heap.peek()


class TraceClock:
    """The policies' clock during a replay: the arrival time of the request being replayed."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def set(self, t: float) -> None:
        self.now = t


@dataclass(frozen=True, slots=True)
class Row:
    capacity_pct: float
    capacity_blocks: int
    policy: str
    result: Result
    ratio: float  # saved FLOPs / per-block LRU's


def run(trace: Trace, capacities: Sequence[float], policies: Sequence[str], bound: bool = True,
        shape: ModelShape | None = None, progress: Callable[[str], None] = lambda s: None) -> list[Row]:
    """Every capacity (percent of unique blocks) x per-block LRU, ``policies`` and the bound."""
    shape = shape or ModelShape.llama3_8b()
    rows: list[Row] = []
    for pct in capacities:
        cap = max(1, int(trace.unique_blocks * pct / 100))
        t0 = time.perf_counter()
        base = replay_per_block_lru(trace, cap, shape)
        results: list[tuple[str, Result]] = [(PER_BLOCK_LRU, base)]
        for name in policies:
            clock = TraceClock()
            policy = make_policy(name, clock=clock, capacity_blocks=cap)
            results.append((name, replay(trace, policy, cap, shape, set_clock=clock.set)))
        if bound:
            oracle = OfflineBound(trace)
            results.append((OFFLINE_BOUND, replay(trace, oracle, cap, shape, on_request=oracle.begin)))
        for name, res in results:
            ratio = res.saved_flops / base.saved_flops if base.saved_flops else float("nan")
            rows.append(Row(pct, cap, name, res, ratio))
        progress(f"{pct:g}%: {cap} blocks, {time.perf_counter() - t0:.1f}s")
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table."""
    out = ["| capacity | blocks | policy | hit tokens | saved prefill FLOPs | x per-block LRU |",
           "|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        name = f"**{r.policy}** (default)" if r.policy == DEFAULT_POLICY else r.policy
        out.append(f"| {r.capacity_pct:g}% | {r.capacity_blocks} | {name} | {r.result.hit_tokens:,} | "
                   f"{r.result.saved_flops:.4e} | {r.ratio:.3f} |")
    return "\n".join(out)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError("capacities are percentages in (0, 100]")
    return values


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.trace_replay", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, default=None, help=f"JSONL trace (default: {DEFAULT_TRACE})")
    source.add_argument("--shape", choices=list(SHAPES), default=None,
                        help="replay a synthetic trace of this shape (tools.workloads) instead of a file")
    parser.add_argument("--requests", type=int, default=None, help="with --shape: how many requests (default 5000)")
    parser.add_argument("--seed", type=int, default=None, help="with --shape: the random seed (default 0)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="with --shape: one of its parameters (python -m tools.workloads --help lists them)")
    parser.add_argument("--capacities", type=_floats, default=[2, 5, 10, 25, 50],
                        help="percentages of the trace's unique full blocks (default: 2,5,10,25,50)")
    parser.add_argument("--policies", type=_names, default=list(POLICIES),
                        help=f"comma-separated, from {', '.join(POLICIES)} (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--no-bound", action="store_true", help="skip the offline bound")
    args = parser.parse_args(argv)
    if args.shape is None and (args.requests is not None or args.seed is not None or args.param):
        parser.error("--requests, --seed and --param go with --shape")
    if args.shape is not None:
        try:
            params = shape_params(args.shape, [f"--{p}" for p in args.param])
            records = generate(args.shape, 5000 if args.requests is None else args.requests, args.seed or 0,
                               block_tokens=BLOCK_TOKENS, **params)
        except ValueError as e:
            parser.error(str(e))
        trace = trace_from_records(records, args.limit)
        print(f"shape {args.shape}, seed {args.seed or 0}" + "".join(f", {p}" for p in args.param) + ": ", end="")
    else:
        path = args.trace or DEFAULT_TRACE
        if not path.is_file():
            print(f"trace not found: {path}", file=sys.stderr)
            return 2
        trace = load_trace(path, args.limit)
    if not trace.unique_blocks:
        print("the trace has no full blocks", file=sys.stderr)
        return 2
    total = sum(len(c) for c in trace.chains)
    print(f"{len(trace.chains)} requests, {total} full blocks of {BLOCK_TOKENS} tokens, "
          f"{trace.unique_blocks} unique; prefill FLOPs of Llama-3-8B\n")
    rows = run(trace, args.capacities, args.policies, bound=not args.no_bound,
               progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
