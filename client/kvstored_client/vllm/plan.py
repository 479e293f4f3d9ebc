"""What the connector's scheduler side tells its worker side each step: which blocks of which
request to load from kvstored and which to store. Pure bookkeeping over block counts and ids; no
vLLM, no daemon, no clock.

A request's blocks are named by vLLM's own chain of block hashes (one per whole block of tokens);
``hashes`` always runs from the prompt's first block, as the SDK's keys do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy chain blocks ``first`` .. ``len(hashes) - 1`` into engine blocks ``block_ids`` (one
    per copied block, in order)."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first: int


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the chain ``hashes``, whose blocks are engine blocks ``block_ids`` (one per hash);
    blocks before ``first`` were stored by an earlier step (the daemon skips what it has)."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first: int


def loadable_blocks(hit_blocks: int, num_tokens: int, block_size: int) -> int:
    """How many of the ``hit_blocks`` cached leading blocks vLLM may take: every whole block of
    the prompt, its last one included (vLLM computes the prompt's last token again, over the
    loaded block; see :func:`external_tokens`)."""
    return max(0, min(hit_blocks, num_tokens // block_size))


def external_tokens(hit_blocks: int, num_tokens: int, num_computed: int, block_size: int) -> int:
    """Tokens to load beyond the ``num_computed`` that vLLM has locally: the loadable blocks'
    tokens, short of the prompt's last token, which vLLM must compute (its logits come from that
    pass). A prompt of whole blocks all cached thus takes all but one token, not all but a block."""
    claimed = min(loadable_blocks(hit_blocks, num_tokens, block_size) * block_size, num_tokens - 1)
    return max(0, claimed - num_computed)


def blocks_spanned(tokens: int, block_size: int) -> int:
    """Blocks holding the first ``tokens`` tokens, a partly filled last one included."""
    return -(-tokens // block_size)


@dataclass(slots=True)
class _Tracked:
    block_ids: list[int]
    saved: int                  # leading chain blocks stored (or loaded from kvstored) so far


@dataclass(slots=True)
class SavePlanner:
    """Per running request, its engine blocks and how much of its chain is stored; ``due`` says
    what a step must store so that every whole block is stored once it is computed (each chunk
    of a chunked prefill, then the blocks decoding fills)."""

    block_size: int
    _requests: dict[str, _Tracked] = field(default_factory=dict)

    def started(self, req_id: str, block_ids: Sequence[int], already_stored: int) -> None:
        """A request scheduled for the first time (or again after preemption, with all its blocks)."""
        old = self._requests.get(req_id)
        self._requests[req_id] = _Tracked(list(block_ids), max(already_stored, old.saved if old else 0))

    def grew(self, req_id: str, new_block_ids: Sequence[int]) -> None:
        """Blocks appended to a running request."""
        tracked = self._requests.get(req_id)
        if tracked is not None:
            tracked.block_ids.extend(new_block_ids)

    def due(self, req_id: str, computed_tokens: int, hashes: Sequence[bytes]) -> SaveSpec | None:
        """What to store once the step leaves ``computed_tokens`` of the request computed, given
        its chain ``hashes`` so far; None if no whole block is newly computed."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return None
        whole = min(computed_tokens // self.block_size, len(hashes), len(tracked.block_ids))
        if whole <= tracked.saved:
            return None
        first, tracked.saved = tracked.saved, whole
        return SaveSpec(req_id, tuple(hashes[:whole]), tuple(tracked.block_ids[:whole]), first)

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests
