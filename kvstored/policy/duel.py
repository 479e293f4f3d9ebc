"""Duel: ``credit``'s order at the scale whose sampled shadow cache saves the most prefill.

``adaptive`` infers one credit scale from its ghost hits and is wrong for a while where that
inference is (a mix of shapes, a short agent loop). Here the scale is measured instead: a fixed
sample of chains, chosen by a hash of a key (so a prompt's blocks are sampled together, as in
SHARDS), is replayed through small shadow caches, one per candidate scale
(``CANDIDATES``: 0 is leaf-only LRU, 1 is ``credit``), each a real prefix index of the sampled
capacity under the same leaf-only policy at that fixed scale. Each shadow counts the prefill its
hits save (a block at depth d weighs ``1 + d / 32``: deeper blocks attend over more context),
decayed over ``window`` sampled accesses; the live tier evicts and admits at the scale of the
shadow ahead, switching only when another leads by ``margin`` (hysteresis). A fresh policy is LRU.
Chains are sampled below the first branch of their path (``_sample_key``): the chains under one
shared system prompt are sampled one by one, not all or none by their common root.

The sample rate is one chain in ``R`` with ``R`` the largest power of two up to 64 that leaves a
shadow at least ``min_shadow`` blocks: a small tier replays every chain (its shadows are exact).
A shadow holds the tier's capacity times the share of stored blocks its sample actually got
(SHARDS' adjustment; at most twice ``1 / R``).
Decisions stay pure: block metadata, the calls it is told about and the injected clock in, a
victim out; no randomness (the sample is a CRC of a key). A lookup costs the policy O(1) when it
continues the chain classified last, else as many blocks as its first branch lies deep (a shared
system prompt's length), plus O(prefix) when its chain is sampled and a shadow lacks part of it
(one chain in ``R``). A save not behind the prefix classified last walks up to the root.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from kvstored.index import Block, PrefixIndex
from kvstored.policy.adaptive import AdaptivePolicy, learned_value
from kvstored.policy.leafheap import index_leaf
from kvstored.policy.one_tier import store_chain

# Chosen on the generated shapes (tools.workloads, seed 0), checked on other seeds and the
# conversation trace: BENCHMARKS.md section 3c.
CANDIDATES = (0.0, 1.0)
DEFAULT_MIN_SHADOW = 4096     # blocks a shadow holds at least (unless the tier is smaller)
DEFAULT_MAX_RATE = 64         # sample at least one chain in this many
DEFAULT_WINDOW = 2000.0       # sampled accesses the shadows' savings are averaged over
DEFAULT_MARGIN = 0.02         # another scale must save this much more to take over
_DEPTH_UNIT = 32.0            # a block at depth d saves 1 + d / 32 (attention over its context)


def _saved(blocks: int) -> float:
    """The weight of a prefix hit of ``blocks`` blocks: sum of 1 + d / 32 for d < blocks."""
    return blocks + blocks * (blocks - 1) / (2 * _DEPTH_UNIT)


class _FixedScale(AdaptivePolicy):
    """``adaptive``'s order and admission at a scale that stays where it is set."""

    def __init__(self, clock: Callable[[], float], ghost_entries: int, scale: float, lane: int = 0) -> None:
        super().__init__(clock, ghost_entries, lane=lane)
        self.scale = scale
        self._built_scale = scale

    def _learn(self, rec: int) -> None:
        pass   # the scale is set from outside, never learned from ghost hits


class _Shadow:
    """A shadow cache: a prefix index of ``capacity`` blocks under a fixed-scale policy, fed the
    sampled chains' accesses; ``score`` is its decayed saved prefill."""

    __slots__ = ("capacity", "index", "policy", "score")

    def __init__(self, clock: Callable[[], float], capacity: int, scale: float) -> None:
        self.capacity = capacity
        self.index = PrefixIndex(0)
        self.policy = _FixedScale(clock, 3 * capacity, scale)
        self.score = 0.0

    def resize(self, capacity: int, exact: bool) -> None:
        """Hold about ``capacity`` blocks (``exact``: that many; else the sample's adjustment sets
        it at the next access), remembering three departed keys per block."""
        if exact:
            self.capacity = capacity
        self.policy.set_ghost_entries(3 * capacity)

    def lookup(self, deepest: bytes, length: int, path: Callable[[], Sequence[bytes]]) -> int:
        """A lookup matched a path of ``length`` blocks ending in ``deepest`` in the live tier
        (``path()``: its keys, root first): hit what this shadow holds, store the rest. Returns
        the shadow's hit length. The keys are asked for only when the path is not all here."""
        block = self.index.get(deepest)
        if block is not None:   # only leaves leave: the whole path is here
            self.policy.hit([block])
            return length
        keys = path()
        hits = self.index.match(keys)
        if hits:
            self.policy.hit(hits)
        store_chain(self.index, self.policy, keys, hits, self.capacity)
        return len(hits)


def _keys(blocks: Sequence[Block]) -> list[bytes]:
    """The keys of ``blocks``, in order."""
    return [b.key for b in blocks]


def _path(block: Block) -> list[bytes]:
    """The keys from the root down to ``block``."""
    keys: list[bytes] = []
    b: Block | None = block
    while b is not None:
        keys.append(b.key)
        b = b.parent
    keys.reverse()
    return keys


def _sample_key(path: Sequence[Block]) -> tuple[bytes, bool]:
    """The key that decides whether the chain ending ``path`` (its blocks, root first) is
    sampled, and whether it came from a branch: the block just below the first branch on the
    path (the first block whose parent has other children), else the root. Sampling by the root
    alone puts every chain under one shared system prompt on the same side; below the first
    branch each conversation, document or agent session is a chain of its own, and it keeps its
    key as it grows turn by turn. Looks only as deep as that first branch."""
    for i in range(1, len(path)):
        if path[i - 1].children > 1:
            return path[i].key, True
    return path[0].key, False


def _ancestry(block: Block) -> list[Block]:
    """The blocks from the root down to ``block``."""
    path: list[Block] = []
    b: Block | None = block
    while b is not None:
        path.append(b)
        b = b.parent
    path.reverse()
    return path


class DuelPolicy(AdaptivePolicy):
    """Leaf-only eviction by ``last use + scale * credit(reuse class)`` and ``credit``'s
    admission at that scale, the scale that of the candidate whose sampled shadow saves most.

    ``clock`` gives seconds (monotonic); ``ghost_entries`` bounds the remembered departed keys;
    ``capacity_blocks`` sizes the shadows; ``can_evict`` and ``lane`` as for ``adaptive``;
    ``defer``: a call's shadow replay waits for :meth:`catch_up` (or the next call), so that a
    store answers before it (the same decisions); ``observed``: the shadows are fed the whole
    store's accesses (:meth:`seen_hit`, :meth:`seen_stored`) instead of this tier's, for a lower
    tier, whose own accesses are what the tiers above it missed.
    """

    name = "duel"

    def __init__(self, clock: Callable[[], float], ghost_entries: int, capacity_blocks: int,
                 can_evict: Callable[[Block], bool] = index_leaf, *, lane: int = 0,
                 candidates: Sequence[float] = CANDIDATES, min_shadow: int = DEFAULT_MIN_SHADOW,
                 max_rate: int = DEFAULT_MAX_RATE, window: float = DEFAULT_WINDOW,
                 margin: float = DEFAULT_MARGIN, defer: bool = False, observed: bool = False) -> None:
        super().__init__(clock, ghost_entries, can_evict=can_evict, lane=lane)
        self._observed = observed
        if not candidates or min(candidates) < 0 or min_shadow < 1 or max_rate < 1 or window < 1 or margin < 0:
            raise ValueError("need candidates >= 0, min_shadow, max_rate and window >= 1, margin >= 0")
        rate = 1
        while rate * 2 <= max_rate and capacity_blocks // (rate * 2) >= min_shadow:
            rate *= 2
        self.sample_rate = rate   # one chain in this many is replayed in the shadows
        cap = max(1, capacity_blocks // rate)
        self._capacity = capacity_blocks
        self._max_shadow = 2 * cap   # bounds the shadows' memory when the sample runs heavy
        self._stored = 0             # blocks stored in the tier, and those of sampled chains
        self._stored_sampled = 0
        # the shadows' clock: the live one, or while a put-off access is replayed, its time
        self._replaying_at: float | None = None
        self._shadows = [_Shadow(self._shadow_time, cap, s) for s in candidates]
        self._candidates = tuple(candidates)
        self._leader = 0
        self.scale = self._candidates[0]
        self._built_scale = self.scale
        self._keep = 1 - 1 / window
        self._margin = 1 + margin
        # the last deepest block whose chain was classified, and whether it is sampled: a save
        # usually continues the prefix its lookup just matched, so its root is not walked to again
        self._memo: Block | None = None
        self._memo_sampled = False
        self._memo_below_branch = False   # its decision came from a branch above it
        # with ``defer``, the sampled accesses of the last call, replayed in the shadows by
        # catch_up (the store calls it once the reply is out) or else first thing in the next call
        self._defer = defer
        self._pending: list[tuple[Block, int, int, int, float]] = []   # deepest, already, the counts, time

    def _learn(self, rec: int) -> None:
        pass   # the scale comes from the duel, not from ghost hits

    @property
    def scores(self) -> tuple[float, ...]:
        """Each candidate's decayed saved prefill in its shadow (read it to see the duel)."""
        self.catch_up()
        return tuple(s.score for s in self._shadows)

    @property
    def shadow_capacity(self) -> int:
        """The blocks each shadow holds (of the sampled chains)."""
        return self._shadows[0].capacity

    def _shadow_time(self) -> float:
        at = self._replaying_at
        return self._clock() if at is None else at

    def catch_up(self) -> None:
        """Replay the sampled accesses put off (``defer``) in the shadows now, in order, each at
        the time it happened."""
        pending = self._pending
        while pending:
            self._pending = []
            try:
                for deepest, already, stored, stored_sampled, at in pending:
                    self._replaying_at = at
                    self._access(deepest, partial(_path, deepest), already, stored, stored_sampled)
            finally:
                self._replaying_at = None
            pending = self._pending

    def _sampled(self, block: Block, path: Sequence[Block] | None = None) -> bool:
        """Is ``block``'s chain in the sample? ``path``: its blocks from the root, when the caller
        has them (a lookup's prefix). O(1) when it continues the chain classified last (the
        first branch on its path is then the same); else as deep as that branch with ``path``,
        O(depth) without."""
        memo = self._memo
        if memo is not None and (block is memo or (block.parent is memo and (
                self._memo_below_branch or memo.children <= 1))):
            return self._memo_sampled
        key, below_branch = _sample_key(_ancestry(block) if path is None else path)
        self._memo_below_branch = below_branch
        return zlib.crc32(key) % self.sample_rate == 0

    def _remember(self, block: Block, sampled: bool) -> None:
        self._memo = block
        self._memo_sampled = sampled

    def _access(self, deepest: Block, path: Callable[[], Sequence[bytes]], already: int,
                stored: int, stored_sampled: int) -> None:
        """Feed the sampled path ending in ``deepest`` (``path()``: its keys, root first) to every
        shadow; each gains what its hits save past the first ``already`` blocks (counted by an
        earlier call of the same request); the leader changes when another shadow's decayed
        saving passes it by the margin. ``stored``, ``stored_sampled``: the tier's counts of
        blocks stored (all, sampled) at the access. The keys are built only if a shadow lacks
        the path: a sampled chain the shadows hold costs O(1), not O(prefix)."""
        keep = self._keep
        length = deepest.depth + 1
        built: list[Sequence[bytes]] = []

        def keys() -> Sequence[bytes]:
            if not built:
                built.append(path())
            return built[0]
        if self.sample_rate > 1 and stored >= self._capacity:
            # SHARDS' adjustment: a shadow holds the tier's capacity times the share of blocks
            # the sample actually got (a few chains may weigh more or less than one in R)
            cap = min(self._max_shadow, max(1, self._capacity * stored_sampled // stored))
            for shadow in self._shadows:
                shadow.capacity = cap
        for shadow in self._shadows:
            h = shadow.lookup(deepest.key, length, keys)
            shadow.score = shadow.score * keep + (_saved(h) - _saved(already) if h > already else 0.0)
        lead = self._shadows[self._leader].score
        best = max(range(len(self._shadows)), key=lambda i: self._shadows[i].score)
        if best != self._leader and self._shadows[best].score > lead * self._margin:
            self._leader = best
        self._steer(self._candidates[self._leader])

    def _steer(self, target: float) -> None:
        """Move the tier's scale towards the leading candidate's ``target`` after a sampled
        access: here at once (a subclass may move it gradually)."""
        self.scale = target

    # -- BlockPolicy (the rest as adaptive's, at the duel's scale) ----------------------------

    def admit(self, key: bytes, full: bool) -> bool:
        if self._pending:
            self.catch_up()
        return super().admit(key, full)

    def removed(self, block: Block, moved: bool = False) -> None:
        if self._pending:
            self.catch_up()
        super().removed(block, moved)

    def victim(self) -> Block | None:
        if self._pending:
            self.catch_up()
        return super().victim()

    def resize(self, capacity_blocks: int) -> None:
        """The tier holds about ``capacity_blocks`` blocks when full (a tier of several block
        sizes learns it as it fills): the shadows hold that many, sampled (the sample rate stays)."""
        if capacity_blocks < 1 or capacity_blocks == self._capacity:
            return
        cap = max(1, capacity_blocks // self.sample_rate)
        # the ghost lists remember as many departed keys per block as they were made to
        self.set_ghost_entries(self._ghost_entries * capacity_blocks // self._capacity)
        self._capacity = capacity_blocks
        self._max_shadow = 2 * cap
        for shadow in self._shadows:
            shadow.resize(cap, exact=self.sample_rate == 1)

    def learned(self) -> dict[str, float]:
        """The tier's scale and the leading shadow's (the shadows themselves start empty again)."""
        self.catch_up()
        return {"scale": self.scale, "target": self._candidates[self._leader]}

    def resume(self, learned: Mapping[str, float]) -> None:
        """Lead with the candidate nearest the recorded leader's scale (fresh shadows score the
        same until they fill, so it leads until another saves more) at the recorded scale."""
        self.catch_up()
        target = learned_value(learned, "target", self._candidates[self._leader])
        self._leader = min(range(len(self._candidates)), key=lambda i: abs(self._candidates[i] - target))
        scale = learned_value(learned, "scale", self.scale)
        self.scale = self._built_scale = min(max(scale, min(self._candidates)), max(self._candidates))

    def hit(self, blocks: Sequence[Block]) -> None:
        if self._pending:
            self.catch_up()
        super().hit(blocks)
        if not self._observed:
            self._feed_hit(blocks)

    def seen_hit(self, blocks: Sequence[Block]) -> None:
        # An SSD tier's own hits are what DRAM missed, and its stores what DRAM evicted: shadows fed
        # those judge a cache that never sees the prompts DRAM serves, whose copies the SSD tier
        # keeps all the same (the tiers are inclusive), and did not find credit's order ahead
        # where it was (BENCHMARKS.md section 3h).
        if self._observed:
            if self._pending:
                self.catch_up()
            self._feed_hit(blocks)

    def seen_stored(self, blocks: Sequence[Block]) -> None:
        if self._observed:
            if self._pending:
                self.catch_up()
            self._feed_inserted(blocks)

    def _feed_hit(self, blocks: Sequence[Block]) -> None:
        if not blocks:
            return
        deepest = blocks[-1]
        from_root = blocks[0].parent is None
        sampled = self._sampled(deepest, blocks if from_root else None)
        self._remember(deepest, sampled)
        if sampled:
            if self._defer:
                self._pending.append((deepest, 0, self._stored, self._stored_sampled, self._clock()))
            else:
                self._access(deepest, partial(_keys, blocks) if from_root else partial(_path, deepest), 0,
                             self._stored, self._stored_sampled)

    def inserted(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        if self._pending:
            self.catch_up()
        super().inserted(blocks, reuses)
        if not self._observed:
            self._feed_inserted(blocks)

    def _feed_inserted(self, blocks: Sequence[Block]) -> None:
        start = 0
        for i in range(1, len(blocks) + 1):   # one access per run of a chain (a parent, then its child)
            if i < len(blocks) and blocks[i].parent is blocks[i - 1]:
                continue
            first, last = blocks[start], blocks[i - 1]
            sampled = self._sampled(first)
            self._remember(last, sampled)
            self._stored += i - start
            if sampled:
                self._stored_sampled += i - start
                if self._defer:
                    self._pending.append((last, first.depth, self._stored, self._stored_sampled, self._clock()))
                else:
                    self._access(last, partial(_path, last), first.depth, self._stored, self._stored_sampled)
            start = i
