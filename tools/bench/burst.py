"""Burst saves: clients save prompts faster than the SSD tier can write them down.

    python -m tools.bench burst [--dram-mib 128] [--ssd-mib 4096] [--block-kib 256] [--blocks 16]
                                [--seconds 8] [--clients 2] [--admission always]

A daemon with a DRAM tier smaller than what the burst saves, and an SSD tier with room. Reports,
beside the disk's own direct write speed in the same directory: saves/s and MB/s; how long saves
waited for the write-back to make room (``kvstored_room_wait_seconds``, from /metrics); blocks
dropped, by reason (0 when admission accepts and the SSD has room). Then the daemon is killed
(SIGKILL) while saves are still arriving and started again on the same directory: which prompts
came back measures the durability window (``ssd.max_dirty_s``) as a crash sees it.
"""

from __future__ import annotations

import argparse
import mmap
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

import kvstored
from tools.bench.common import REPO_ROOT, free_port, percentile


def raw_write_gbps(path: Path, nbytes: int, chunk: int) -> float:
    """O_DIRECT sequential writes of ``nbytes`` in ``chunk``-byte writes, fdatasync every 32."""
    import os
    src = mmap.mmap(-1, chunk)
    src.write(np.random.default_rng(0).integers(0, 255, size=chunk, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        began = time.perf_counter()
        for i in range(nbytes // chunk):
            os.pwrite(fd, src, i * chunk)
            if i % 32 == 31:
                os.fdatasync(fd)
        os.fdatasync(fd)
        return nbytes / (time.perf_counter() - began) / 1e9
    finally:
        os.close(fd)
        path.unlink()


def rows(i: int, blocks: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ``i``: its tokens and rows whose bytes say which prompt and block they are."""
    tokens = np.arange(16 * blocks) + 1_000_000 * (i + 1)
    data = np.empty((blocks, width), dtype=np.uint8)
    for b in range(blocks):
        data[b] = np.frombuffer((i * 65_537 + b).to_bytes(8, "little") * (width // 8), dtype=np.uint8)
    return tokens, data


class Daemon:
    """A kvstored process on a socket in ``base``, its SSD tier there too, /metrics on a port."""

    def __init__(self, base: Path, args: list[str]) -> None:
        self.socket = str(base / "kv.sock")
        self.metrics_port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstored", "--no-config", "--socket", self.socket, "--ssd-path", str(base / "ssd"),
             "--set", f"server.metrics=127.0.0.1:{self.metrics_port}", "--set", f"dram.shm_dir={base / 'shm'}",
             *args], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                kvstored.Client(self.socket).close()
                return
            except kvstored.DaemonNotRunning:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.2)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)


def wait_buckets(metrics: str) -> list[tuple[str, int]]:
    """``kvstored_room_wait_seconds``'s buckets, cumulative, as exposed."""
    return [(le, int(float(n))) for le, n in
            re.findall(r'^kvstored_room_wait_seconds_bucket\{le="([^"]+)"\} (\S+)$', metrics, re.M)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dram-mib", type=int, default=128, help="the daemon's DRAM tier (default 128)")
    p.add_argument("--ssd-mib", type=int, default=4096, help="the daemon's SSD tier (default 4096)")
    p.add_argument("--block-kib", type=int, default=256, help="block size (default 256)")
    p.add_argument("--blocks", type=int, default=16, help="blocks per prompt (default 16)")
    p.add_argument("--seconds", type=float, default=8.0, help="how long the clients save (default 8)")
    p.add_argument("--clients", type=int, default=2, help="clients saving at once (default 2)")
    p.add_argument("--admission", default="always", help="ssd.admission (default always)")
    p.add_argument("--dir", default=None, help="where the daemon's files go (default: a temp directory)")
    args = p.parse_args(argv)
    width = args.block_kib << 10
    prompt_bytes = width * args.blocks
    # never more than the SSD tier holds: a lost prompt then means the crash, not an eviction
    most = (args.ssd_mib << 20) * 8 // 10 // prompt_bytes
    base = Path(tempfile.mkdtemp(prefix="kvstored-burst-", dir=args.dir))
    (base / "shm").mkdir()
    daemon_args = ["--dram-capacity", f"{args.dram_mib}MiB", "--ssd-capacity", f"{args.ssd_mib}MiB",
                   "--set", f"ssd.admission={args.admission}", "--set", "dram.prefault=false"]
    try:
        disk = raw_write_gbps(base / "raw.dat", 512 << 20, min(prompt_bytes, 2 << 20))
        d = Daemon(base, daemon_args)
        saved: list[tuple[int, float]] = []   # (prompt, when its save returned)
        lock = threading.Lock()
        next_prompt = iter(range(most))
        stop = time.monotonic() + args.seconds
        errors: list[str] = []

        def saver() -> None:
            with kvstored.Client(d.socket) as c:
                while time.monotonic() < stop:
                    with lock:
                        i = next(next_prompt, None)
                    if i is None:
                        return
                    tokens, data = rows(i, args.blocks, width)
                    try:
                        res = c.save(tokens, data)
                    except kvstored.KVStoreError as exc:   # the kill: the rest is the restart's to judge
                        errors.append(type(exc).__name__)
                        return
                    if res.stored + res.present == args.blocks:
                        with lock:
                            saved.append((i, time.monotonic()))

        began = time.monotonic()
        threads = [threading.Thread(target=saver, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(max(0.0, stop - time.monotonic() - 0.05))
        metrics = d.metrics()
        with kvstored.Client(d.socket) as c:
            stats = c.stats()
        killed = time.monotonic()
        d.stop(signal.SIGKILL)                  # saves still arriving
        for t in threads:
            t.join(30)
        elapsed = killed - began
        again = Daemon(base, daemon_args)
        try:
            with kvstored.Client(again.socket) as c:
                back = {i for i, _ in saved if c.lookup(rows(i, args.blocks, width)[0]).blocks == args.blocks}
                sample = sorted(back)[:: max(1, len(back) // 20)]
                short = wrong = 0   # loads of fewer blocks than the lookup found; with other bytes
                for i in sample:
                    tokens, want = rows(i, args.blocks, width)
                    got = c.load(tokens)
                    if got.blocks < args.blocks:
                        short += 1
                    elif not np.array_equal(got.data, want):
                        wrong += 1
        finally:
            again.stop()
        lost_ages = sorted(killed - when for i, when in saved if i not in back)
        buckets = wait_buckets(metrics)
        waits = buckets[-1][1] if buckets else 0
        print(f"burst: {args.clients} clients saving {args.blocks} x {args.block_kib} KiB prompts for "
              f"{elapsed:.1f} s into {args.dram_mib} MiB DRAM + {args.ssd_mib} MiB SSD "
              f"(ssd.admission={args.admission})")
        print("| figure | value |\n|---|---|")
        print(f"| disk, direct sequential write | {disk:.2f} GB/s |")
        print(f"| saves | {len(saved)} prompts, {len(saved) / elapsed:.1f}/s, "
              f"{len(saved) * prompt_bytes / elapsed / 1e9:.2f} GB/s |")
        print(f"| saves that waited for room | {waits} (median about "
              f"{_median_bucket(buckets)} s; sum {stats['room_wait_seconds']:.2f} s) |")
        print(f"| wait histogram (cumulative, s) | {', '.join(f'<={le}: {n}' for le, n in buckets)} |")
        print(f"| blocks dropped | {stats['dropped_blocks']} {stats['dropped_blocks_by_reason'] or ''} |")
        verdict = "bytes intact" if not wrong else f"bytes WRONG in {wrong}"
        if short:
            verdict += f", {short} loaded SHORT of what lookup found"
        print(f"| after kill -9 and restart | {len(back)} of {len(saved)} saved prompts back, {verdict} "
              f"(sample of {len(sample)} loaded) |")
        if lost_ages:
            print(f"| lost | {len(lost_ages)} prompts, saved {lost_ages[0]:.2f}-{lost_ages[-1]:.2f} s "
                  f"before the kill (p50 {percentile(lost_ages, 0.5):.2f} s) |")
        else:
            print("| lost | none |")
        return 0 if not (short or wrong) else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _median_bucket(buckets: list[tuple[str, int]]) -> str:
    """The upper bound of the bucket holding the median wait ("-" when none waited)."""
    if not buckets or not buckets[-1][1]:
        return "-"
    half = buckets[-1][1] / 2
    return next(le for le, n in buckets if n >= half)


if __name__ == "__main__":
    raise SystemExit(main())
