"""Prompts as runs of labelled content, and the chained block ids of a prompt.

A prompt is a sequence of :data:`Segment` ``(label, tokens)``: ``tokens`` tokens of content named
``label`` (a system prompt, a document, one user message...). Equal labels mean equal content, so
two prompts agree on their first T tokens exactly when their segments up to token T agree.
:class:`BlockIds` numbers the blocks of prompts the way prefix hashes do: a full block's id is
determined by its parent's id and its own content, so two prompts share a block id only if they
share every token up to the end of that block; a partial last block gets a fresh id, never seen
again (it would hash differently once it filled). Ids are 0, 1, 2... in order of first appearance,
as in the conversation trace.
"""

from __future__ import annotations

from collections.abc import Sequence

Segment = tuple[int, int]   # (content label, tokens)
# (label, first token, end token) of each run of content inside one block
_Piece = tuple[int, int, int]


class BlockIds:
    """Assigns chained ids to the blocks of prompts; one instance per trace."""

    def __init__(self, block_tokens: int = 512) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_tokens = block_tokens
        self._known: dict[tuple[int, tuple[_Piece, ...]], int] = {}
        self._next = 0

    def _fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def chain(self, prompt: Sequence[Segment]) -> list[int]:
        """The ids of ``prompt``'s blocks, ``ceil(tokens / block_tokens)`` of them, root first."""
        size = self.block_tokens
        ids: list[int] = []
        parent = -1
        pieces: list[_Piece] = []
        filled = 0
        for label, tokens in prompt:
            start = 0
            while start < tokens:
                take = min(tokens - start, size - filled)
                pieces.append((label, start, start + take))
                start += take
                filled += take
                if filled == size:
                    key = (parent, tuple(pieces))
                    known = self._known.get(key)
                    if known is None:
                        known = self._known[key] = self._fresh()
                    parent = known
                    ids.append(parent)
                    pieces.clear()
                    filled = 0
        if filled:
            ids.append(self._fresh())
        return ids


def prompt_tokens(prompt: Sequence[Segment]) -> int:
    return sum(tokens for _, tokens in prompt)
