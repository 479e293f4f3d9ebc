"""What a trace offers a prefix cache: requests, unique full blocks, the infinite-cache hit ratio."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    unique_blocks: int          # distinct full blocks
    hit_ratio: float            # full blocks an infinite prefix cache serves / full blocks asked for
    median_prompt_tokens: float

    def __str__(self) -> str:
        return (f"{self.requests:,} requests, {self.unique_blocks:,} unique full blocks, "
                f"infinite-cache block hit ratio {self.hit_ratio:.3f}, "
                f"median prompt {self.median_prompt_tokens:,.0f} tokens")


def summarize(records: Iterable[Mapping[str, Any]], block_tokens: int = 512) -> Summary:
    """Only full blocks count, as in the trace replay: a partial last block is never reused."""
    seen: set[int] = set()
    asked = hits = requests = 0
    lengths: list[int] = []
    for record in records:
        requests += 1
        lengths.append(int(record["input_length"]))
        full = record["hash_ids"][: int(record["input_length"]) // block_tokens]
        # chained ids: a block seen before has its whole prefix seen before, so a cache that
        # never evicts serves every such block as part of the request's cached prefix
        hits += sum(1 for h in full if h in seen)
        asked += len(full)
        seen.update(full)
    return Summary(requests, len(seen), hits / asked if asked else 0.0,
                   statistics.median(lengths) if lengths else 0.0)
