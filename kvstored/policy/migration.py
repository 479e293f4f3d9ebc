"""The ledger of a prefill/decode handover: how long the decode node waits for a prompt's KV when
it pulls the whole prefix after the prefill, and when each chunk is pushed as the prefill finishes
it (first-block pipelining), the transfer overlapping the rest of the prefill. Pure: a prefill
schedule and a link in, seconds out."""

from __future__ import annotations

from dataclasses import dataclass

from kvstored.policy.cost import ModelShape, prefix_prefill_flops


@dataclass(frozen=True, slots=True)
class Link:
    """A peer link as the ledger sees it: a fixed cost per transfer and a rate."""

    latency_s: float
    bytes_per_s: float


def chunk_ends(blocks: int, chunk: int) -> list[int]:
    """The block counts done after each chunk of a prefill of ``blocks`` blocks."""
    if blocks < 1 or chunk < 1:
        raise ValueError(f"bad prefill: {blocks} blocks in chunks of {chunk}")
    return [min(end, blocks) for end in range(chunk, blocks + chunk, chunk)]


def prefill_schedule(shape: ModelShape, blocks: int, block_tokens: int, chunk: int,
                     flops_per_s: float) -> list[float]:
    """Seconds from the prefill's start until each chunk is done (the cost model's FLOPs: later
    chunks cost more, their attention spans the prefix before them)."""
    return [prefix_prefill_flops(shape, end, block_tokens) / flops_per_s for end in chunk_ends(blocks, chunk)]


def kv_ready_whole(schedule: list[float], blocks: int, block_bytes: int, link: Link) -> float:
    """KV on the decode node when it pulls the whole prefix after the prefill."""
    return schedule[-1] + link.latency_s + blocks * block_bytes / link.bytes_per_s


def kv_ready_pipelined(schedule: list[float], blocks: int, chunk: int, block_bytes: int, link: Link) -> float:
    """KV on the decode node when each chunk leaves as it is done: the link sends the chunks in
    order, none before it is computed; the last lands a link latency after it is sent."""
    sent = 0.0
    done = 0
    for at, end in zip(schedule, chunk_ends(blocks, chunk)):
        sent = max(sent, at) + (end - done) * block_bytes / link.bytes_per_s
        done = end
    return sent + link.latency_s
