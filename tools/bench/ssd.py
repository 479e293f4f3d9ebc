"""SSD tier vs the disk itself, side by side in one run: 2 MiB blocks.

- raw write: sequential O_DIRECT writes of the blocks + one fsync per batch of 32;
  SSD tier write: SSDTier.put of the same blocks (one writer thread, group commit, fsync).
- raw read: random O_DIRECT reads, queue depth 1; SSD tier read: SSDTier.read_into (checksum
  verified) in random order, cold: the environment is closed (unmapped), the file's pages are
  dropped from the page cache (posix_fadvise DONTNEED) and it is opened again (and its index read
  once, as the daemon's restore does), so both read payloads from the device. Reads alternate
  block by block, raw then tier, each timed on its own: this disk's speed swings by 1.5x within
  seconds, and alternating per block puts both under the same conditions.
- the same reads at the daemon's queue depth, as the daemon reads a prompt (its read pool has
  ``ssd.read_threads`` threads, ``--read-threads`` here): that many blocks at a time, raw through a
  pool of as many threads doing the same O_DIRECT reads, tier through ``read_into`` on a tier with
  as many read threads; groups alternate raw then tier. At depth 1 the tier pays two thread
  hand-offs (caller to read thread and back) that the raw read in the caller's thread does not;
  deeper, both pay them.
- the same SSD-tier figures again after writing 3x the tier's capacity in churn (deletes +
  puts), where LMDB's reuse of freed pages for large values decides the speed.
- the product path (``--daemon-blocks``, 0 to skip): a daemon in a subprocess, ``Client.load_blocks``
  of a prompt whose blocks are on its SSD tier only (saved, flushed, evicted from DRAM, the tier's
  files dropped from the page cache) into the engine's registered buffers, against raw O_DIRECT
  reads of as many blocks, each into a slot of its own, through as many threads as the daemon has
  read threads (``--read-threads``, default: the daemon's default ``ssd.read_threads``), in the
  same run; the same load again once the blocks are back in DRAM (what the load costs above the disk); and
  ``Client.stream`` of the prompt from DRAM and from SSD again, into the buffers and (from SSD) out
  of the arena without buffers: the first block's latency against one raw read.
- the event loop while a long prompt comes up (``--small-blocks``, 0 to skip): a daemon's
  ``load_blocks`` of a prompt of that many 64 KiB blocks found on SSD only, while a second client
  calls ``lookup`` of one block in a loop; the load's speed against raw O_DIRECT reads of as many
  64 KiB blocks at the daemon's depth, and the second client's call latency during the load against the same
  calls with the daemon idle (every block's promotion is set up on the event loop, so this is
  what other engines on the node wait).

    python -m tools.bench ssd [--dir DIR] [--blocks 256] [--runs 5] [--daemon-blocks 64]
                              [--small-blocks 2048] [--read-threads N]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import kvstored
from kvstored import Namespace
from kvstored.config import SSDConfig
from kvstored.tiers.ssd import SSDTier
from tools.bench.local_daemon import local_daemon

BLOCK = 2 << 20
SMALL = 64 << 10   # the blocks of the event-loop section


def aligned(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)  # page aligned, as O_DIRECT wants
    buf.write(np.random.default_rng(0).integers(0, 255, size=n, dtype=np.uint8).tobytes())
    return buf


def drop_cache(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold(ssd: SSDTier, base: Path, capacity: int, read_threads: int) -> SSDTier:
    """Close (unmap) the tier, drop its pages from the page cache, open it again and read its
    index once, as the daemon's restore does at start: payload reads are cold, the index is not."""
    ssd.close()
    drop_cache(base / "lmdb")
    ssd = SSDTier(str(base / "lmdb"), int(capacity * 1.5), read_threads,
                  disk_budget=SSDConfig(capacity=capacity).disk_budget)   # as the daemon opens it
    for _ in ssd.scan():
        pass
    return ssd


def raw_write(path: Path, blocks: int, src: mmap.mmap) -> float:
    """Overwrites of allocated blocks, as the tier's writes into reused slots are (main() fills the
    file once before the runs): an O_TRUNC here made every raw run allocate, ~25-30% slower on ext4,
    while the tier from its third run on only overwrote, which flattered "tier write vs raw"."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        t = time.perf_counter()
        for i in range(blocks):
            os.pwrite(fd, src, i * BLOCK)
            if i % 32 == 31:
                os.fdatasync(fd)
        os.fdatasync(fd)
        return blocks * BLOCK / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def tier_write(ssd: SSDTier, blocks: int, src: np.ndarray, start: int) -> float:
    t = time.perf_counter()
    futures = [ssd.put(1, (start + i).to_bytes(32, "big"), b"", 0, src) for i in range(blocks)]
    for f in futures:
        f.result(120)
    return blocks * BLOCK / (time.perf_counter() - t) / 1e9


def paired_reads(raw_path: Path, raw_blocks: int, ssd: SSDTier, keys: list[int], raw_dst: mmap.mmap,
                 out: np.ndarray) -> tuple[float, float]:
    """Alternate one raw O_DIRECT read and one tier read per key (random order); (raw, tier) GB/s."""
    order = list(keys)
    random.Random(2).shuffle(order)
    raw_order = [random.Random(k).randrange(raw_blocks) for k in order]
    fd = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
    raw_s = tier_s = 0.0
    try:
        for k, r in zip(order, raw_order):
            t = time.perf_counter()
            os.preadv(fd, [raw_dst], r * BLOCK)
            raw_s += time.perf_counter() - t
            t = time.perf_counter()
            ssd.read_into(1, k.to_bytes(32, "big"), out).result(60)
            tier_s += time.perf_counter() - t
    finally:
        os.close(fd)
    n = len(order) * BLOCK
    return n / raw_s / 1e9, n / tier_s / 1e9


def paired_reads_deep(raw_path: Path, raw_blocks: int, ssd: SSDTier, keys: list[int],
                      raw_dst: list[mmap.mmap], out: list[np.ndarray]) -> tuple[float, float]:
    """Alternate ``len(out)`` raw O_DIRECT reads (on a pool of as many threads) and as many tier
    reads, per group of keys (random order); (raw, tier) GB/s."""
    depth = len(out)
    order = list(keys)
    random.Random(4).shuffle(order)
    raw_order = [random.Random(k + 1).randrange(raw_blocks) for k in order]
    fd = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
    raw_s = tier_s = 0.0
    pool = ThreadPoolExecutor(depth)
    try:
        for i in range(0, len(order) - depth + 1, depth):
            t = time.perf_counter()
            reads = [pool.submit(os.preadv, fd, [raw_dst[j]], raw_order[i + j] * BLOCK) for j in range(depth)]
            for r in reads:
                r.result(60)
            raw_s += time.perf_counter() - t
            t = time.perf_counter()
            futs = [ssd.read_into(1, order[i + j].to_bytes(32, "big"), out[j]) for j in range(depth)]
            for f in futs:
                f.result(60)
            tier_s += time.perf_counter() - t
    finally:
        pool.shutdown()
        os.close(fd)
    n = (len(order) // depth) * depth * BLOCK
    return n / raw_s / 1e9, n / tier_s / 1e9


def raw_reads_into_slots(raw_path: Path, raw_blocks: int, n: int, dst: mmap.mmap, seed: int,
                         depth: int, block: int = BLOCK) -> float:
    """``n`` random O_DIRECT reads of ``block`` bytes from ``raw_path`` (``raw_blocks`` blocks of
    BLOCK), read i into slot i of ``dst``, ``depth`` at a time on as many threads (as the daemon's
    read pool reads a prompt); GB/s."""
    order = [random.Random(seed + i).randrange(raw_blocks * (BLOCK // block)) for i in range(n)]
    view = memoryview(dst)
    fd = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
    try:
        with ThreadPoolExecutor(depth) as pool:
            t = time.perf_counter()
            for f in [pool.submit(os.preadv, fd, [view[i * block:(i + 1) * block]], r * block)
                      for i, r in enumerate(order)]:
                f.result(60)
            return n * block / (time.perf_counter() - t) / 1e9
    finally:
        view.release()
        os.close(fd)


def raw_read_ms(raw_path: Path, raw_blocks: int, dst: mmap.mmap, seed: int) -> float:
    """Milliseconds of one random O_DIRECT block read in the caller's thread."""
    fd = os.open(raw_path, os.O_RDONLY | os.O_DIRECT)
    view = memoryview(dst)
    try:
        t = time.perf_counter()
        os.preadv(fd, [view[:BLOCK]], random.Random(seed).randrange(raw_blocks) * BLOCK)
        return (time.perf_counter() - t) * 1e3
    finally:
        view.release()
        os.close(fd)


def timed_load(client: kvstored.Client, buffers: Any, engine: np.ndarray, chain: list[bytes],
               expected: np.ndarray, where: str) -> float:
    """``Client.load_blocks`` of ``chain``, all found in tier ``where``, into ``buffers`` (whose
    memory ``engine`` is zeroed first), checked against ``expected``; GB/s."""
    engine[:] = 0
    t = time.perf_counter()
    got = client.load_blocks(buffers, list(range(len(chain))), hashes=chain)
    rate = len(chain) * BLOCK / (time.perf_counter() - t) / 1e9
    assert got.blocks == len(chain) and got.per_tier.get(where) == len(chain), f"the load found {got}"
    assert np.array_equal(engine, expected), f"the load from {where} gave other bytes"
    return rate


def timed_stream(client: kvstored.Client, buffers: Any, engine: np.ndarray, chain: list[bytes],
                 expected: np.ndarray, where: str) -> tuple[float, float]:
    """``Client.stream`` of ``chain``, found in tier ``where`` ("dram" or "ssd"), into
    ``buffers`` (whose memory ``engine`` is zeroed first), checked against ``expected``:
    (ms to its first block, GB/s over the whole prompt)."""
    engine[:] = 0
    t = time.perf_counter()
    stream = client.stream(hashes=chain, buffers=buffers, block_ids=list(range(len(chain))))
    first = 0.0
    tiers = set()
    for arrival in stream:
        if arrival.index == 0:
            first = (time.perf_counter() - t) * 1e3
        tiers.add(arrival.tier)
    rate = len(chain) * BLOCK / (time.perf_counter() - t) / 1e9
    assert stream.outcome is not None and stream.outcome.complete, stream.outcome
    assert tiers == {where}, f"the stream found blocks in {tiers}, not only in {where}"
    assert np.array_equal(engine, expected), f"the stream from {where} gave other bytes"
    return first, rate


def timed_arena_stream(client: kvstored.Client, ns: Namespace, chain: list[bytes],
                       expected: np.ndarray, where: str) -> tuple[float, float]:
    """``Client.stream`` of ``chain`` without engine buffers (each block copied out of the arena
    as it arrives), all found in tier ``where``, checked against ``expected``: (ms to its first
    block, GB/s over the whole prompt)."""
    t = time.perf_counter()
    stream = client.stream(hashes=chain, namespace=ns, peers=False)
    first = 0.0
    for arrival in stream:
        if arrival.index == 0:
            first = (time.perf_counter() - t) * 1e3
        assert arrival.tier == where, f"block {arrival.index} came from {arrival.tier}, not {where}"
        assert np.array_equal(np.asarray(arrival.data).reshape(-1), expected[arrival.index]), \
            f"the arena stream from {where} gave other bytes for block {arrival.index}"
    rate = len(chain) * expected.shape[1] / (time.perf_counter() - t) / 1e9
    assert stream.outcome is not None and stream.outcome.complete, stream.outcome
    return first, rate


def bench_daemon(ssd_path: Path, n: int, block: int, read_threads: int) -> Any:
    """A daemon in a subprocess whose DRAM holds two ``n``-block prompts of ``block`` bytes and
    whose SSD tier (in ``ssd_path``) holds four, read by ``read_threads`` threads; its client."""
    return local_daemon("--dram-capacity", str(max(2 * n * block, 64 << 20)), "--set", "dram.page_bytes=32MiB",
                        "--set", f"ssd.capacity={4 * n * block}", "--set", f"ssd.read_threads={read_threads}",
                        "--log-level", "warning", ssd_path=ssd_path)


def prompt_on_ssd(client: kvstored.Client, buffers: Any, engine: np.ndarray, model: str,
                  rng: np.random.Generator, ssd_path: Path) -> tuple[np.ndarray, list[bytes]]:
    """Save a fresh prompt of random bytes filling ``engine``, flush it, evict it from DRAM and
    drop the tier's files from the page cache: (its bytes, its block hashes)."""
    n = engine.shape[0]
    rows = rng.integers(0, 255, size=engine.shape, dtype=np.uint8)
    engine[:] = rows
    chain = [rng.bytes(32) for _ in range(n)]
    saved = client.save_blocks(buffers, list(range(n)), hashes=chain)
    assert saved.stored == n, f"the daemon stored {saved.stored} of {n} blocks"
    written = client.flush(model)
    assert written == n, f"flush wrote {written} of {n} blocks"
    dropped = client.evict(model, tier="dram")
    assert dropped == n, f"evict dropped {dropped} of {n} DRAM copies"
    drop_cache(ssd_path)
    return rows, chain


def daemon_loads(base: Path, raw_blocks: int, n: int, runs: int, depth: int) -> dict[str, list[float]]:
    """Per run, in GB/s: raw O_DIRECT reads of ``n`` blocks into slots of their own, ``depth`` at a
    time (the daemon's ``depth`` read threads); a daemon's
    ``load_blocks`` of an ``n``-block prompt found on its SSD tier only, into registered buffers;
    the same load again from DRAM; a ``stream`` of the prompt from SSD only again, into the buffers
    and without them (out of the arena). In ms: one raw block read, and the first block of a
    stream from SSD (both kinds) and of one from DRAM. Every load and
    stream is checked against the bytes saved."""
    rows: dict[str, list[float]] = {"raw read of the load's blocks, the daemon's depth": [],
                                    "daemon load_blocks from SSD": [], "daemon load_blocks from DRAM": [],
                                    "daemon stream from SSD": [], "daemon stream from SSD, out of the arena": [],
                                    "raw read of one block, ms": [],
                                    "daemon stream from SSD, first block, ms": [],
                                    "daemon stream from SSD out of the arena, first block, ms": [],
                                    "daemon stream from DRAM, first block, ms": []}
    ssd_path = base / "daemon-ssd"
    ns = Namespace(model="bench-ssd", block_bytes=BLOCK)
    raw_dst = mmap.mmap(-1, n * BLOCK)
    engine = kvstored.shm.empty((n, BLOCK), "uint8")
    rng = np.random.default_rng(3)
    try:
        with bench_daemon(ssd_path, n, BLOCK, depth) as client:
            buffers = client.register_buffers([engine.numpy()], 0, namespace=ns)
            for run in range(runs + 1):   # the first run warms up
                rows_now, chain = prompt_on_ssd(client, buffers, engine.numpy(), ns.model, rng, ssd_path)
                raw = raw_reads_into_slots(base / "raw", raw_blocks, n, raw_dst, run * n, depth)
                from_ssd = timed_load(client, buffers, engine.numpy(), chain, rows_now, "ssd")
                from_dram = timed_load(client, buffers, engine.numpy(), chain, rows_now, "dram")
                first_dram, _ = timed_stream(client, buffers, engine.numpy(), chain, rows_now, "dram")
                assert client.evict(ns.model, tier="dram") == n
                drop_cache(ssd_path)
                one = raw_read_ms(base / "raw", raw_blocks, raw_dst, seed=run)
                first, streamed = timed_stream(client, buffers, engine.numpy(), chain, rows_now, "ssd")
                assert client.evict(ns.model, tier="dram") == n
                drop_cache(ssd_path)
                first_arena, arena = timed_arena_stream(client, buffers.namespace, chain, rows_now, "ssd")
                client.evict(ns.model)
                if run:
                    for name, value in zip(rows, (raw, from_ssd, from_dram, streamed, arena, one, first, first_arena,
                                                  first_dram)):
                        rows[name].append(value)
            client.unregister_buffers(buffers)
    finally:
        engine.close()
        raw_dst.close()
    return rows


def lookups_until(client: kvstored.Client, chain: list[bytes], stop: threading.Event, most: int) -> list[float]:
    """ms of each ``lookup`` of ``chain``'s first block, made one after another until ``stop`` is
    set or ``most`` calls were made."""
    latencies: list[float] = []
    while not stop.is_set() and len(latencies) < most:
        t = time.perf_counter()
        client.lookup(hashes=chain[:1])
        latencies.append((time.perf_counter() - t) * 1e3)
    return latencies


def loop_while_promoting(base: Path, raw_blocks: int, n: int, runs: int, depth: int) -> dict[str, list[float]]:
    """Per run: raw reads of ``n`` 64 KiB blocks, ``depth`` at a time (GB/s); a daemon's ``load_blocks`` of an
    ``n``-block prompt of 64 KiB blocks on its SSD tier only (GB/s, checked against the bytes
    saved); a second client's lookup latency during that load (median and max, ms) and with the
    daemon idle (median, ms)."""
    rows: dict[str, list[float]] = {"raw 64 KiB reads, the daemon's depth": [], "daemon load_blocks from SSD": [],
                                    "lookup, daemon idle, median ms": [],
                                    "lookup during the load, median ms": [], "lookup during the load, max ms": []}
    ssd_path = base / "small-ssd"
    ns = Namespace(model="bench-small", block_bytes=SMALL)
    engine = kvstored.shm.empty((n, SMALL), "uint8")
    raw_dst = aligned(n * SMALL)
    rng = np.random.default_rng(5)
    try:
        with bench_daemon(ssd_path, n, SMALL, depth) as client, kvstored.Client(client.socket, namespace=ns) as other:
            buffers = client.register_buffers([engine.numpy()], 0, namespace=ns)
            ids = list(range(n))
            for run in range(runs + 1):   # the first run warms up
                rows_now, chain = prompt_on_ssd(client, buffers, engine.numpy(), ns.model, rng, ssd_path)
                raw = raw_reads_into_slots(base / "raw", raw_blocks, n, raw_dst, run * n, depth, block=SMALL)
                idle = lookups_until(other, chain, threading.Event(), 200)
                stop = threading.Event()
                with ThreadPoolExecutor(1) as pool:
                    during = pool.submit(lookups_until, other, chain, stop, 100_000)
                    time.sleep(0.05)   # the lookups are under way
                    try:
                        engine.numpy()[:] = 0
                        t = time.perf_counter()
                        got = client.load_blocks(buffers, ids, hashes=chain)
                        rate = n * SMALL / (time.perf_counter() - t) / 1e9
                    finally:
                        stop.set()
                    latencies = during.result(60)
                assert got.blocks == n and got.per_tier.get("ssd") == n, f"the load found {got}"
                assert np.array_equal(engine.numpy(), rows_now), "the load from SSD gave other bytes"
                client.evict(ns.model)
                if run:
                    for name, value in zip(rows, (raw, rate, statistics.median(idle), statistics.median(latencies),
                                                  max(latencies))):
                        rows[name].append(value)
            client.unregister_buffers(buffers)
    finally:
        engine.close()
        raw_dst.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench ssd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--daemon-blocks", type=int, default=64,
                        help="blocks per load in the daemon section (0: skip it)")
    parser.add_argument("--small-blocks", type=int, default=2048,
                        help="64 KiB blocks per load in the event-loop section (0: skip it)")
    parser.add_argument("--read-threads", type=int, default=SSDConfig().read_threads,
                        help="the daemons' ssd.read_threads, and the depth of the raw reads they are compared with")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(dir=args.dir))
    src = aligned(BLOCK)
    dst = aligned(BLOCK)
    payload = np.frombuffer(src, dtype=np.uint8)
    out = np.frombuffer(aligned(BLOCK), dtype=np.uint8)  # like an arena slot: page aligned
    depth = args.read_threads
    dst_deep = [aligned(BLOCK) for _ in range(depth)]
    out_deep = [np.frombuffer(aligned(BLOCK), dtype=np.uint8) for _ in range(depth)]
    capacity = args.blocks * BLOCK
    ssd = SSDTier(str(base / "lmdb"), int(capacity * 1.5), depth, disk_budget=SSDConfig(capacity=capacity).disk_budget)
    rows: dict[str, list[float]] = {k: [] for k in ("raw write", "tier write", "raw read", "tier read",
                                                      "raw read, the daemon's depth", "tier read, the daemon's depth",
                                                      "tier write after churn", "raw read after churn",
                                                      "tier read after churn")}
    try:
        try:
            raw_write(base / "raw", args.blocks, src)   # allocate the raw file once, outside the runs
            for run in range(args.runs):
                rows["raw write"].append(raw_write(base / "raw", args.blocks, src))
                drop_cache(base)
                first = run * args.blocks * 10
                rows["tier write"].append(tier_write(ssd, args.blocks, payload, first))
                ssd = cold(ssd, base, capacity, depth)
                drop_cache(base)
                raw_rate, tier_rate = paired_reads(base / "raw", args.blocks, ssd,
                                                   list(range(first, first + args.blocks)), dst, out)
                rows["raw read"].append(raw_rate)
                rows["tier read"].append(tier_rate)
                ssd = cold(ssd, base, capacity, depth)
                drop_cache(base)
                raw_rate, tier_rate = paired_reads_deep(base / "raw", args.blocks, ssd,
                                                        list(range(first, first + args.blocks)), dst_deep, out_deep)
                rows["raw read, the daemon's depth"].append(raw_rate)
                rows["tier read, the daemon's depth"].append(tier_rate)
                for i in range(first, first + args.blocks):
                    ssd.delete(1, i.to_bytes(32, "big"))
            # churn: 3x capacity of deletes and puts through the same map
            live: list[int] = []
            key = 10**9
            for _ in range(3):
                for _ in range(args.blocks):
                    if len(live) >= args.blocks * 0.9:
                        ssd.delete(1, live.pop(0).to_bytes(32, "big"))
                    ssd.put(1, key.to_bytes(32, "big"), b"", 0, payload).result(120)
                    live.append(key)
                    key += 1
            for _ in range(args.runs):
                while len(live) > args.blocks * 0.5:
                    ssd.delete(1, live.pop(0).to_bytes(32, "big")).result(60)
                fresh = list(range(key, key + args.blocks // 4))
                key += len(fresh)
                rows["tier write after churn"].append(tier_write(ssd, len(fresh), payload, fresh[0]))
                live.extend(fresh)
                ssd = cold(ssd, base, capacity, depth)
                drop_cache(base)
                raw_rate, tier_rate = paired_reads(base / "raw", args.blocks, ssd, fresh, dst, out)
                rows["raw read after churn"].append(raw_rate)
                rows["tier read after churn"].append(tier_rate)
            size = sum(f.stat().st_blocks * 512 for f in (base / "lmdb").iterdir() if f.is_file())
        finally:
            ssd.close()
        daemon = daemon_loads(base, args.blocks, args.daemon_blocks, args.runs, depth) if args.daemon_blocks else {}
        small = (loop_while_promoting(base, args.blocks, args.small_blocks, args.runs, depth)
                 if args.small_blocks else {})
    finally:
        shutil.rmtree(base, ignore_errors=True)   # the raw file and the tiers: a GiB a run
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nSSD tier vs raw disk, {BLOCK >> 20} MiB blocks, {args.blocks} blocks per run, the daemon's depth "
          f"{depth} (its read threads), medians of {args.runs}\n")
    print("| operation | GB/s median | min | max | vs raw |")
    print("|---|---|---|---|---|")
    for name, values in rows.items():
        raw = med["raw write" if "write" in name else "raw read after churn" if "churn" in name
                  else "raw read, the daemon's depth" if "depth" in name else "raw read"]
        print(f"| {name} | {med[name]:.2f} | {min(values):.2f} | {max(values):.2f} | "
              f"{med[name] / raw:.2f} |")
    print(f"\nSSD tier files after churn: {size / 2**20:.0f} MiB on disk for {capacity / 2**20:.0f} MiB "
          f"of capacity")
    if daemon:
        dmed = {k: statistics.median(v) for k, v in daemon.items()}
        raw = dmed["raw read of the load's blocks, the daemon's depth"]
        print(f"\nThe product path: a daemon's load_blocks of a {args.daemon_blocks}-block prompt "
              f"({args.daemon_blocks * BLOCK >> 20} MiB), {args.read_threads} read threads (the raw reads' depth), "
              f"medians of {args.runs}\n")
        print("| operation | GB/s median | min | max | vs raw |")
        print("|---|---|---|---|---|")
        for name, values in daemon.items():
            if name.endswith(", ms"):
                continue
            print(f"| {name} | {dmed[name]:.2f} | {min(values):.2f} | {max(values):.2f} | {dmed[name] / raw:.2f} |")
        print("\n| latency | ms median | min | max | vs raw |")
        print("|---|---|---|---|---|")
        one = dmed["raw read of one block, ms"]
        for name in ("raw read of one block, ms", "daemon stream from SSD, first block, ms",
                     "daemon stream from SSD out of the arena, first block, ms",
                     "daemon stream from DRAM, first block, ms"):
            lo, hi = min(daemon[name]), max(daemon[name])
            print(f"| {name[:-4]} | {dmed[name]:.2f} | {lo:.2f} | {hi:.2f} | {dmed[name] / one:.2f} |")
    if small:
        smed = {k: statistics.median(v) for k, v in small.items()}
        print(f"\nThe event loop while a prompt of {args.small_blocks} blocks of 64 KiB comes up from SSD, "
              f"{args.read_threads} read threads, medians of {args.runs}\n")
        print("| operation | median | min | max | vs |")
        print("|---|---|---|---|---|")
        for name, values in small.items():
            base_name = ("lookup, daemon idle, median ms" if name.endswith(" ms")
                         else "raw 64 KiB reads, the daemon's depth")
            unit = "ms" if name.endswith(" ms") else "GB/s"
            label = name[:-3] if name.endswith(" ms") else name
            print(f"| {label} ({unit}) | {smed[name]:.2f} | {min(values):.2f} | {max(values):.2f} | "
                  f"{smed[name] / smed[base_name]:.2f} |")
    return 0

