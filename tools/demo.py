"""Demo scenarios against a running kvstored, through the public SDK only.

A toy "engine" whose KV for a block is a deterministic function of the block's key, shaped like a
small Llama (16 layers, 8 KV heads, head dim 64, fp16: 512 KiB per 16-token block). It shows:
1. a request's KV saved after prefill; 2. a second request reusing the shared system prompt;
3. a multi-turn conversation prefilling only the new turn; 4. the engine-buffer path
(register_buffers + save_blocks/load_blocks) with a vLLM-style paged layout; 5. prefill and decode on
two more daemons started here (peers on loopback): the prefill node pushes each chunk as it is saved,
then a decode node that has nothing streams a prompt from its peer block by block, then the
handover ledger: a paced prefill whose prompt the decode node pulls after it, or gets pushed
chunk by chunk while it runs, each next to the ledger's prediction; 6. the SSD tier:
DRAM written to SSD and emptied, a prompt loaded from SSD without a prefetch, another prefetched
ahead of its load, and the tiering ledger with those loads' speeds (from which block keeping a
block in DRAM or on SSD beats recomputing it, and each load against recomputing its prompt).
With ``--after-restart`` (demo.sh runs it once the daemon has been stopped and started again on
the same state): 7. prompts saved before the restart are found on SSD and served.
Every reused block is checked byte for byte against what the engine computed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import kvstored
from kvstored import Namespace
from kvstored.policy.cost import ModelShape, TierCosts, break_even, prefix_prefill_flops
from kvstored.policy.migration import Link, chunk_ends, kv_ready_pipelined, kv_ready_whole, prefill_schedule

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
ROW_SHAPE = (LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)  # one block: every layer's K and V
NS = Namespace(model="demo-llama-1b", kv_dtype="float16", block_size=BLOCK)
# the ledgers' model (5c, 6e): this engine's shape at an inference GPU's modest share of its peak
DEMO_SHAPE = ModelShape(params=1.2e9, layers=LAYERS, d_model=2048, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
PREFILL_FLOPS = 1e14


def prefill(tokens: np.ndarray) -> np.ndarray:
    """The toy engine's KV for every whole block of ``tokens``: a function of each block's key."""
    keys = kvstored.block_hashes(tokens, BLOCK)
    out = np.empty((len(keys), *ROW_SHAPE), dtype=np.float16)
    for i, key in enumerate(keys):
        out[i] = np.random.default_rng(int.from_bytes(key[:8], "little")).standard_normal(
            ROW_SHAPE, dtype=np.float32)
    return out


def words(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128_000, size=n)


def whole(tokens: np.ndarray) -> int:
    """The tokens of ``tokens``' whole blocks (only those are stored)."""
    return len(tokens) // BLOCK * BLOCK


def connect(wait_s: float, daemon_pid: int = 0) -> kvstored.Client:
    """A client of the daemon, waiting up to ``wait_s`` for it to serve; gives up at once when the
    daemon process ``daemon_pid`` (the one demo.sh started) is gone."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return kvstored.Client(client_name="demo")
        except kvstored.DaemonNotRunning:
            if daemon_pid:
                try:
                    os.kill(daemon_pid, 0)
                except ProcessLookupError:
                    raise SystemExit(f"kvstored (pid {daemon_pid}) exited before serving") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def serve(client: kvstored.Client, prompt: np.ndarray, label: str, reuses: int = 0) -> np.ndarray:
    """One request: reuse what is cached, 'prefill' the rest, save; returns the full KV.
    ``reuses``: the leading tokens an earlier scenario stored, which must come back."""
    t0 = time.perf_counter()
    hit = client.lookup(prompt, namespace=NS)
    t_lookup = time.perf_counter() - t0
    t0 = time.perf_counter()
    cached = client.load(prompt, namespace=NS, dtype=np.float16)
    t_load = time.perf_counter() - t0
    reused = cached.data.reshape(-1, *ROW_SHAPE)
    full = prefill(prompt)  # the toy engine computes everything; a real one only the suffix
    assert np.array_equal(reused, full[: cached.blocks]), "restored KV differs from the engine's"
    saved = client.save(prompt, full, namespace=NS)
    mib = cached.blocks * reused[0].nbytes / 2**20 if cached.blocks else 0
    print(f"{label:<36} prompt {len(prompt):>5} tok | cached {hit.tokens:>5} tok "
          f"({100 * hit.tokens / len(prompt):3.0f}%) | lookup {t_lookup * 1e3:5.2f} ms | "
          f"load {mib:6.1f} MiB in {t_load * 1e3:6.2f} ms | prefill {len(prompt) - cached.tokens:>5} tok "
          f"| stored {saved.stored} new blocks")
    # what the scenario is about: the prefix stored before comes back (the lookup and the load
    # both find it), and this request's blocks are all stored for the next one
    assert hit.tokens >= reuses and cached.tokens >= reuses, \
        f"{label}: {reuses} tokens were stored before, but the lookup found {hit.tokens} and the load {cached.tokens}"
    assert saved.present + saved.stored == len(full), \
        f"{label}: {len(full)} blocks to keep, but {saved.present} were cached and {saved.stored} stored"
    return full


def engine_buffers(client: kvstored.Client) -> None:
    """vLLM-style paged buffers per layer, (2, num_blocks, block, heads, dim), in shared memory."""
    ns = Namespace(model="demo-llama-1b-paged", kv_dtype="float16", block_size=BLOCK)
    shape = (2, 64, BLOCK, KV_HEADS, HEAD_DIM)
    engine_a = [kvstored.shm.empty(shape, "float16") for _ in range(LAYERS)]
    engine_b = [kvstored.shm.empty(shape, "float16") for _ in range(LAYERS)]
    rng = np.random.default_rng(1)
    for t in engine_a:
        t.numpy()[...] = rng.standard_normal(shape, dtype=np.float32)
    a = client.register_buffers([t.numpy() for t in engine_a], block_dim=1, namespace=ns)
    b = client.register_buffers([t.numpy() for t in engine_b], block_dim=1, namespace=ns)
    prompt = words(7, 16 * 32)
    src_blocks = list(range(10, 42))
    saved = client.save_blocks(a, src_blocks, prompt)
    t0 = time.perf_counter()
    loaded = client.load_blocks(b, list(range(32)), prompt)
    dt = time.perf_counter() - t0
    same = all(np.array_equal(x.numpy()[:, 10:42], y.numpy()[:, :32]) for x, y in zip(engine_a, engine_b))
    mib = loaded.blocks * (2 * BLOCK * KV_HEADS * HEAD_DIM * 2 * LAYERS) / 2**20
    print(f"{'4. engine buffers (vLLM layout)':<36} saved {saved.stored} blocks from engine A, loaded "
          f"{loaded.blocks} into engine B ({mib:.0f} MiB in {dt * 1e3:.2f} ms), identical: {same}")
    client.unregister_buffers(a)
    client.unregister_buffers(b)
    assert same, "engine B's blocks differ from engine A's"


@contextlib.contextmanager
def two_nodes() -> Iterator[tuple[kvstored.Client, kvstored.Client]]:
    """A prefill node and a decode node: daemons with peer channels on loopback ports."""
    with tempfile.TemporaryDirectory(prefix="kvstored-demo-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        clients: list[kvstored.Client] = []
        try:
            for attempt in range(3):   # a port picked free may be taken before the daemon binds it
                if _start_nodes(Path(tmp), procs, clients, last_try=attempt == 2):
                    break
                _stop_nodes(procs, clients)
            yield clients[0], clients[1]
        finally:
            _stop_nodes(procs, clients)


def pick_ports(n: int) -> list[int]:
    """``n`` loopback ports free now (another process may take one before a daemon binds it)."""
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def _start_nodes(tmp: Path, procs: list[subprocess.Popen[bytes]], clients: list[kvstored.Client],
                 last_try: bool) -> bool:
    """Start the two daemons on fresh loopback ports and connect to them (appending to ``procs``
    and ``clients``); False when a daemon found its port taken meanwhile (unless ``last_try``)."""
    ports = pick_ports(2)
    static = f"prefill=127.0.0.1:{ports[0]},decode=127.0.0.1:{ports[1]}"
    for name, port in zip(("prefill", "decode"), ports):
        sock = str(tmp / f"{name}.sock")
        log = tmp / f"{name}.log"
        with open(log, "wb") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvstored", "--no-config", "--socket", sock, "--dram-capacity",
                 "256MiB", "--set", "ssd.enabled=false", "--set", f"peers.listen=127.0.0.1:{port}",
                 "--set", f"peers.node_id={name}", "--set", f"peers.static={static}",
                 "--set", "peers.token=demo-token", "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=err))
        deadline = time.monotonic() + 30
        while True:
            try:
                clients.append(kvstored.Client(sock, client_name=f"demo-{name}"))
                break
            except kvstored.DaemonNotRunning:
                if procs[-1].poll() is not None:   # its log goes with the temp directory: show it
                    text = log.read_text(errors="replace")
                    if "address already in use" in text and not last_try:
                        return False
                    raise SystemExit(f"the {name} daemon exited ({procs[-1].returncode}) before serving:\n"
                                     + text) from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    return True


def _stop_nodes(procs: list[subprocess.Popen[bytes]], clients: list[kvstored.Client]) -> None:
    for c in clients:
        c.close()
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    procs.clear()
    clients.clear()


def disaggregated() -> None:
    print("\n5. prefill/decode on two more daemons started for this (peer channels on loopback; their "
          "counters are not in the kvctl stats below)")
    with two_nodes() as (prefill_node, decode_node):
        prompt = np.concatenate([words(11, 1024), words(12, 1000)])
        kv = prefill(prompt)
        t0 = time.perf_counter()
        for end in range(16, len(kv) + 16, 16):   # chunked prefill: 16 blocks a chunk
            n = min(end, len(kv))
            prefill_node.save(prompt[: n * BLOCK], kv[:n], namespace=NS, push_to="decode")
        deadline = time.monotonic() + 30
        while decode_node.lookup(prompt, namespace=NS).blocks < len(kv) and time.monotonic() < deadline:
            time.sleep(0.005)
        pushed = decode_node.lookup(prompt, namespace=NS)
        print(f"{'5a. prefill node pushes to decode':<36} {len(kv)} blocks saved chunk by chunk with push_to="
              f"'decode': {pushed.blocks} on the decode node after {1e3 * (time.perf_counter() - t0):.0f} ms")
        assert pushed.blocks == len(kv), "the decode node did not get every pushed block"
        got = decode_node.load(prompt, namespace=NS, dtype=np.float16).data.reshape(-1, *ROW_SHAPE)
        assert np.array_equal(got, kv), "pushed KV differs from the prefill node's"
        # another prompt only the prefill node holds: the decode node pulls it, block by block
        other = np.concatenate([words(13, 1024), words(14, 1000)])
        other_kv = prefill(other)
        prefill_node.save(other, other_kv, namespace=NS)
        hit = decode_node.lookup(other, namespace=NS, peers=True)
        t0 = time.perf_counter()
        stream = decode_node.stream(other, namespace=NS)
        first = 0.0
        arrived: list[int] = []
        for arrival in stream:
            if arrival.index == 0:
                first = time.perf_counter() - t0
            assert arrival.tier == "peer", f"block {arrival.index} came from {arrival.tier!r}, not the peer"
            assert np.array_equal(arrival.data.view(np.float16).reshape(ROW_SHAPE), other_kv[arrival.index])
            arrived.append(arrival.index)
        last = time.perf_counter() - t0
        out = stream.outcome
        assert out is not None and out.complete, out
        assert hit.per_peer.get("prefill") == len(other_kv), f"lookup(peers=True) saw {hit.per_peer}"
        assert arrived == list(range(len(other_kv))) and out.blocks == len(other_kv), \
            f"{len(other_kv)} blocks to stream, in order; {len(arrived)} arrived ({out.blocks} by the outcome)"
        print(f"{'5b. decode node streams from peer':<36} lookup(peers=True) {hit.per_tier}, per peer "
              f"{hit.per_peer}; first block after {first * 1e3:.1f} ms, all {out.blocks} after {last * 1e3:.1f} ms")
        handover(prefill_node, decode_node)


def handover(prefill_node: kvstored.Client, decode_node: kvstored.Client) -> None:
    """5c: the seed's migration ledger made into numbers. A prompt's prefill paced at what this
    model costs at PREFILL_FLOPS, 16 blocks a chunk; the decode node pulls it after the prefill, or
    gets each chunk pushed as it is done; each measured next to the ledger, whose link speed is
    that of a pull of another prompt just before."""
    probe = np.concatenate([words(21, 1024), words(22, 1000)])
    probe_kv = prefill(probe)
    prefill_node.save(probe, probe_kv, namespace=NS)
    t0 = time.perf_counter()
    assert decode_node.pull(probe, namespace=NS).complete
    link = Link(0.0, probe_kv.nbytes / (time.perf_counter() - t0))
    took: dict[bool, float] = {}
    for push in (False, True):
        prompt = np.concatenate([words(17 + push, 1024), words(19 + push, 1000)])
        kv = prefill(prompt)
        n = len(kv)
        schedule = prefill_schedule(DEMO_SHAPE, n, BLOCK, 16, PREFILL_FLOPS)
        start = time.perf_counter()
        for at, end in zip(schedule, chunk_ends(n, 16)):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            prefill_node.save(prompt[: end * BLOCK], kv[:end], namespace=NS, push_to="decode" if push else "")
        if push:
            deadline = time.monotonic() + 30
            while decode_node.lookup(prompt, namespace=NS).blocks < n and time.monotonic() < deadline:
                time.sleep(0.001)
        else:
            assert decode_node.pull(prompt, namespace=NS).complete
        took[push] = time.perf_counter() - start
        got = decode_node.load(prompt, namespace=NS, dtype=np.float16).data.reshape(-1, *ROW_SHAPE)
        assert np.array_equal(got, kv), "the decode node's KV differs from the prefill node's"
    whole = kv_ready_whole(schedule, n, kv[0].nbytes, link)
    piped = kv_ready_pipelined(schedule, n, 16, kv[0].nbytes, link)
    print(f"{'5c. handover, prefill paced':<36} {n} blocks, prefill {schedule[-1] * 1e3:.0f} ms at "
          f"{PREFILL_FLOPS:.0e} FLOP/s; KV on the decode node: pulled after the prefill {took[False] * 1e3:.0f} ms "
          f"(ledger {whole * 1e3:.0f}), pushed chunk by chunk {took[True] * 1e3:.0f} ms (ledger {piped * 1e3:.0f})")


def check_load(client: kvstored.Client, prompt: np.ndarray, label: str) -> tuple[float, float]:
    """Load ``prompt``, which must be cached whole, and check it against the engine's KV; returns
    the MiB loaded and the seconds the load took."""
    t0 = time.perf_counter()
    cached = client.load(prompt, namespace=NS, dtype=np.float16)
    dt = time.perf_counter() - t0
    full = prefill(prompt)
    assert cached.blocks == len(full), f"{label}: {len(full)} blocks cached before, {cached.blocks} loaded"
    assert np.array_equal(cached.data.reshape(-1, *ROW_SHAPE), full), f"{label}: KV differs from the engine's"
    return cached.data.nbytes / 2**20, dt


def ssd_tier(client: kvstored.Client, conversation: np.ndarray, other: np.ndarray, shared: int,
             later: np.ndarray) -> None:
    """Scenario 6: every DRAM block written to SSD and dropped from DRAM; ``conversation`` loaded
    from SSD as it is, ``other`` (whose first ``shared`` tokens it shares) prefetched ahead of its
    load; ``later`` saved after, in DRAM only (the daemon's stop writes it to SSD); then the
    tiering ledger with the two loads' speeds."""
    print()
    written = client.flush()
    dropped = client.evict(tier="dram")
    hit = client.lookup(conversation, namespace=NS)
    print(f"{'6a. DRAM to SSD, then emptied':<36} flush wrote {written} blocks, evict dropped {dropped} "
          f"from DRAM; the conversation is now {hit.per_tier}")
    assert hit.per_tier == {"ssd": hit.blocks} and hit.blocks == whole(conversation) // BLOCK, hit
    mib, dt = check_load(client, conversation, "6b")
    from_ssd = (whole(conversation) // BLOCK, mib, dt)
    after = client.lookup(conversation, namespace=NS)
    print(f"{'6b. load from SSD, no prefetch':<36} {mib:.1f} MiB in {dt * 1e3:.2f} ms, identical; "
          f"now {after.per_tier}")
    assert after.per_tier == {"dram": after.blocks}, after
    # (no lookup first: a lookup that finds blocks on SSD starts bringing them up by itself)
    started = client.prefetch(other, namespace=NS)
    deadline = time.monotonic() + 30
    while client.lookup(other, namespace=NS).per_tier.get("ssd") and time.monotonic() < deadline:
        time.sleep(0.005)
    mib, dt = check_load(client, other, "6c")
    from_dram = (whole(other) // BLOCK, mib, dt)
    print(f"{'6c. prefetch, then load':<36} prefetch of {started.blocks} cached blocks: {started.per_tier} "
          f"(the system prompt came up in 6b); then {mib:.1f} MiB from DRAM in {dt * 1e3:.2f} ms, identical")
    assert started.blocks == whole(other) // BLOCK, started
    assert started.per_tier == {"promoting": started.blocks - shared // BLOCK}, started
    serve(client, later, "6d. a request after the flush")
    tiering_ledger(from_dram, from_ssd)


def tiering_ledger(from_dram: tuple[int, float, float], from_ssd: tuple[int, float, float]) -> None:
    """6e: the seed's tiering inequality, ``prefill_cost(block) > read_cost(tier) + write_cost``,
    with the read speeds the loads of 6c (DRAM) and 6b (SSD) had here and this model's prefill at
    PREFILL_FLOPS: from which block on keeping blocks in each tier pays, and each load against
    recomputing its prompt."""
    cost = {}
    for tier, (_, mib, seconds) in (("dram", from_dram), ("ssd", from_ssd)):
        rate = mib * 2**20 / seconds
        cost[tier] = TierCosts(tier, rate, rate)
    block_bytes = int(np.prod(ROW_SHAPE)) * 2
    even = {t: break_even(DEMO_SHAPE, BLOCK, block_bytes, PREFILL_FLOPS, c, cost["dram"]) for t, c in cost.items()}
    loads = "; ".join(f"{blocks} blocks from {tier.upper()} {seconds * 1e3:.0f} ms against recomputing them "
                      f"{prefix_prefill_flops(DEMO_SHAPE, blocks, BLOCK) / PREFILL_FLOPS * 1e3:.0f} ms"
                      for tier, (blocks, _, seconds) in (("dram", from_dram), ("ssd", from_ssd)))
    pays = ", ".join(f"{t.upper()} ({cost[t].read_bytes_per_s / 1e9:.2f} GB/s here) from block "
                     f"{'never' if even[t] is None else even[t]}" for t in cost)
    print(f"{'6e. tiering ledger':<36} at {PREFILL_FLOPS:.0e} FLOP/s, keeping a block pays in {pays}; {loads}")


def after_restart(client: kvstored.Client, prompts: list[tuple[str, np.ndarray]]) -> None:
    """Scenario 7, on a daemon started again on the state of the one that ran 1-6: ``prompts``
    saved then are found on SSD and come back whole and intact."""
    print(f"connected to kvstored {client.daemon_version} on {client.socket}, started again on the same state\n")
    for label, prompt in prompts:
        hit = client.lookup(prompt, namespace=NS)
        assert hit.blocks == whole(prompt) // BLOCK and hit.per_tier == {"ssd": hit.blocks}, \
            f"{label}: {whole(prompt) // BLOCK} blocks saved before the restart; found {hit.per_tier}"
        mib, dt = check_load(client, prompt, label)
        print(f"{label:<36} {hit.blocks} blocks found on SSD; {mib:.1f} MiB loaded in {dt * 1e3:.2f} ms, identical")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wait", type=float, default=0, help="seconds to wait for the daemon")
    parser.add_argument("--daemon-pid", type=int, default=0,
                        help="the daemon's process: stop waiting for it as soon as it is gone")
    parser.add_argument("--after-restart", action="store_true",
                        help="scenario 7 only, against a daemon restarted on the state of one that ran the rest")
    args = parser.parse_args()
    system = words(1, 1024)
    second = np.concatenate([system, words(3, 180)])
    turn1 = np.concatenate([system, words(4, 300)])
    turn2 = np.concatenate([turn1, words(5, 120), words(6, 90)])  # + answer + next question
    turn3 = np.concatenate([turn2, words(8, 100), words(9, 60)])
    later = np.concatenate([words(15, 512), words(16, 100)])
    with connect(args.wait, args.daemon_pid) as client:
        if args.after_restart:
            after_restart(client, [("7a. conversation (flushed in 6a)", turn3),
                                   ("7b. request 6d (written at the stop)", later)])
            return 0
        print(f"connected to kvstored {client.daemon_version} on {client.socket}\n")
        serve(client, np.concatenate([system, words(2, 200)]), "1. first request (cold)")
        serve(client, second, "2. same system prompt, new question", reuses=whole(system))
        serve(client, turn1, "3a. conversation, turn 1", reuses=whole(system))
        serve(client, turn2, "3b. conversation, turn 2", reuses=whole(turn1))
        serve(client, turn3, "3c. conversation, turn 3", reuses=whole(turn2))
        engine_buffers(client)
        disaggregated()
        ssd_tier(client, turn3, second, whole(system), later)
    return 0


if __name__ == "__main__":
    sys.exit(main())
