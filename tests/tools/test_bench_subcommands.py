"""``python -m tools.bench SUBCOMMAND``: every focused benchmark answers ``--help`` with the options
BENCHMARKS.md's commands use, and the cheap ones run end to end at a tiny size and print the table
a user reads. Speed is never asserted (the machine is shared and small), only that every row is
there with figures and that nothing is left behind.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tools.bench.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]

# subcommand -> the options it must keep (the commands in BENCHMARKS.md and README.md use them)
OPTIONS = {
    "ssd": ["--dir", "--blocks", "--runs", "--daemon-blocks", "--small-blocks", "--read-threads"],
    "lookup": ["--policy", "--blocks", "--calls", "--repeats"],
    "copy": ["--batch", "--layers", "--calls"],
    "pages": ["--dirs", "--arena-mib", "--batch", "--rounds", "--calls"],
    "gc": ["--blocks", "--new", "--runs"],
    "model": ["--tokens", "--runs"],
    "peers": ["--blocks", "--block-bytes", "--run-bytes", "--runs", "--no-mooncake", "--mooncake-python"],
    "cluster": ["--runs", "--block-bytes", "--run-bytes", "--ttfb-block-bytes", "--no-mooncake",
                "--skip-throughput", "--skip-ttfb", "--out"],
    "tiering": ["--tokens", "--runs", "--out"],
    "migration": ["--tokens", "--runs", "--model", "--flops", "--block-bytes", "--chunk", "--decode-ms", "--out"],
    "gpu": [],
    "saves": ["--sizes", "--batches", "--dram-mib"],
    "burst": ["--dram-mib", "--ssd-mib", "--block-kib", "--blocks", "--seconds", "--clients", "--admission", "--dir"],
    "transports": ["--calls", "--warmup", "--runs", "--clients", "--messages", "--transports", "--out"],
    "vllm": ["--tokens", "--runs", "--shape", "--dtype", "--hidden", "--layers", "--lmcache", "--out"],
    "vllm-decode": ["--tokens", "--runs", "--link-mib-s", "--hidden", "--layers"],
}


def bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    """``python -m tools.bench *args`` from the repository root, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "tools.bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The Markdown table rows printed: first cell -> the other cells."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_every_subcommand_has_its_options_listed_here() -> None:
    assert sorted(OPTIONS) == sorted(SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_a_subcommand_answers_help_with_its_options(name: str) -> None:
    out = bench(name, "--help", timeout=120).stdout
    assert out.startswith(f"usage: python -m tools.bench {name} "), out
    missing = [option for option in OPTIONS[name] if option not in out]
    assert missing == [], out


def test_the_side_by_side_help_names_every_subcommand() -> None:
    out = bench("--help", timeout=60).stdout
    assert "--quick" in out and "--no-peers" in out
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in out, (name, out)


def test_lookup_prints_each_policy() -> None:
    out = bench("lookup", "--blocks", "256", "--calls", "3", "--repeats", "1", "--policy", "lru,credit").stdout
    lines = [line for line in out.splitlines() if "leased lookup + release" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["lru", "credit"], out
    assert all("(256 blocks, best of 1 x 3)" in line for line in lines), out


def test_copy_prints_each_block_size_and_layout() -> None:
    out = bench("copy", "--batch", "2", "--layers", "4", "--calls", "1").stdout
    lines = [line for line in out.splitlines() if "save min" in line and "load min" in line]
    assert [line.split(":")[0].split() for line in lines] == [
        ["256", "KiB", "x", "2,", "1", "tensor(s)"], ["256", "KiB", "x", "2,", "4", "tensor(s)"],
        ["2048", "KiB", "x", "2,", "1", "tensor(s)"], ["2048", "KiB", "x", "2,", "4", "tensor(s)"]], out


def test_pages_prints_every_copy_of_every_directory(tmp_path: Path) -> None:
    out = bench("pages", "--dirs", f"{tmp_path},/dev/shm", "--arena-mib", "8", "--batch", "2", "--rounds", "1",
                "--calls", "1").stdout
    assert f"arena in {tmp_path}: 8 MiB," in out and "arena in /dev/shm: 8 MiB," in out, out
    for where in (f"arena in {tmp_path}", "arena in /dev/shm", "heap (the process's own memory)"):
        for op in ("put", "get"):
            for block in ("2048", "256"):
                assert any(" ".join(line.split()).startswith(f"{op} {block} KiB x 2, {where}: median")
                           and "GB/s" in line for line in out.splitlines()), (op, block, where, out)


def test_gc_prints_every_pause() -> None:
    """The full pass before and after the freeze, the freezes and the thaw."""
    rows = table_rows(bench("gc", "--blocks", "20000", "--new", "2000", "--runs", "1", timeout=120).stdout)
    for name in ("full pass, nothing frozen", "the freeze (a pass, then gc.freeze)", "full pass after the freeze",
                 "the next freeze, 2,000 blocks later", "a thaw (everything unfrozen, one full pass, frozen again)"):
        assert name in rows, f"row {name!r} missing: {rows}"
        assert float(rows[name][0]) >= 0


def test_ssd_runs_the_tier_and_the_daemon_path_and_prints_both_tables(tmp_path: Path) -> None:
    """Every tier row against raw, the daemon's load and stream of a prompt found on SSD only, and
    its load of many small blocks with another client's calls meanwhile (the run itself checks the
    bytes each returns)."""
    out = bench("ssd", "--dir", str(tmp_path), "--blocks", "8", "--runs", "1", "--daemon-blocks", "4",
                "--small-blocks", "64", "--read-threads", "3").stdout
    rows = table_rows(out)
    for name in ("raw write", "tier write", "raw read", "tier read", "tier read, the daemon's depth",
                 "tier read after churn",
                 "raw read of the load's blocks, the daemon's depth", "daemon load_blocks from SSD",
                 "daemon load_blocks from DRAM", "daemon stream from SSD", "daemon stream from SSD, out of the arena",
                 "daemon stream from SSD out of the arena, first block", "raw read of one block",
                 "daemon stream from SSD, first block", "daemon stream from DRAM, first block",
                 "raw 64 KiB reads, the daemon's depth (GB/s)", "daemon load_blocks from SSD (GB/s)",
                 "lookup, daemon idle, median (ms)", "lookup during the load, median (ms)",
                 "lookup during the load, max (ms)"):
        assert name in rows, f"row {name!r} missing:\n{out}"
        assert all(float(x) > 0 for x in rows[name][:4]), rows[name]
    # every comparison at the depth asked for: the daemons were started with that many read threads
    assert "the daemon's depth 3" in out and out.count("3 read threads") == 2, out
    assert not list(tmp_path.iterdir()), f"the run left files behind: {list(tmp_path.iterdir())}"


def test_peers_measures_each_path_against_raw_tcp() -> None:
    """The raw sender, the kvstored senders (uvloop, asyncio, mutual TLS when cryptography is
    there) each run in a process of their own, started by module; Mooncake left out, saying why."""
    out = bench("peers", "--runs", "5", "--blocks", "4", "--block-bytes", str(64 << 10),
                "--run-bytes", str(256 << 10), "--no-mooncake").stdout
    rows = table_rows(out)
    for name in ("raw TCP (blocking sendall / recv_into)", "kvstored peers (uvloop)", "kvstored peers (asyncio)",
                 "kvstored peers (uvloop, mutual TLS)"):
        assert name in rows, f"row {name!r} missing:\n{out}"
    for name in ("raw TCP (blocking sendall / recv_into)", "kvstored peers (uvloop)", "kvstored peers (asyncio)"):
        assert int(rows[name][0]) >= 5 and float(rows[name][1]) > 0, rows[name]
    assert rows["Mooncake TE tcp (batch_transfer_sync_read)"][-1] == "not measured: left out (--no-mooncake)"
    assert "kvstored / Mooncake: n/a" in out


def test_cluster_ships_between_two_daemons_and_writes_its_results(tmp_path: Path) -> None:
    """Two daemons on loopback (the shipping part only: the pipelined load's prompts are fixed at
    up to 128k tokens); its results.json next to the table."""
    out = bench("cluster", "--runs", "5", "--block-bytes", "256KiB", "--run-bytes", "2MiB", "--skip-ttfb",
                "--ttfb-block-bytes", "4KiB",  # the daemons are sized for the (skipped) prompts: keep them small
                "--no-mooncake", "--out", str(tmp_path / "out")).stdout
    rows = table_rows(out)
    for name in ("raw TCP (the run's blocks)", "raw TCP (32 blocks cycled)", "kvstored pull (Client.pull)",
                 "kvstored pull (stream)", "kvstored push (migrate)"):
        assert name in rows and float(rows[name][0]) > 0, f"row {name!r} missing:\n{out}"
    assert (tmp_path / "out" / "results.json").exists()


def test_tiering_serves_a_prompt_from_each_tier_and_prints_the_break_even(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    proc = bench("tiering", "--tokens", "64", "--runs", "1", "--out", str(tmp_path), timeout=600)
    rows = table_rows(proc.stdout)
    assert len(rows["64"]) == 4 and set(rows["llama-3-8b"]) <= {"never"} | {str(i) for i in range(1 << 20)}
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["median"]) == {"fresh", "dram", "ssd", "peer"}


def test_migration_hands_a_prompt_to_the_decode_node_both_ways(tmp_path: Path) -> None:
    """Both ways to the decode node run end to end (B holds every block, or the run fails), each
    row has a measured TTFT and the model's, and the prefill's cost grows with the prompt."""
    out = bench("migration", "--tokens", "256,512", "--runs", "1", "--chunk", "4", "--block-bytes", "16KiB",
                "--out", str(tmp_path), timeout=600).stdout
    rows = table_rows(out)
    assert {"256", "512"} <= set(rows), out
    for tokens in ("256", "512"):
        for cell in rows[tokens][1:3]:   # whole, pipelined: "measured (model)"
            measured, model = cell.replace("(", "").replace(")", "").split()
            assert float(measured) > 0 and float(model) > 0, out
    assert float(rows["512"][0]) > float(rows["256"][0]), out
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["predicted"]) == {"whole_s", "pipelined_s"} and results["link"]["bytes_per_s"] > 0


def test_burst_saves_past_dram_drops_nothing_and_measures_a_kill(tmp_path: Path) -> None:
    """Saves into a DRAM tier smaller than them, an SSD tier with room: nothing dropped, and after
    the kill -9 the saved prompts come back with their bytes (but for the durability window)."""
    out = bench("burst", "--seconds", "2", "--dram-mib", "32", "--ssd-mib", "512", "--blocks", "8",
                "--block-kib", "64", "--dir", str(tmp_path)).stdout
    rows = table_rows(out)
    assert rows["blocks dropped"][0].startswith("0 "), out
    # every sampled prompt loaded whole (not short of what lookup found) with its own bytes
    assert re.search(r"back, bytes intact \(sample of \d+ loaded\)$", rows["after kill -9 and restart"][0]), out
    assert {"disk, direct sequential write", "saves", "saves that waited for room", "lost"} <= set(rows), out
    assert list(tmp_path.iterdir()) == [], "the daemon's files were left behind"


def test_saves_times_both_phases_for_every_size_and_batch() -> None:
    """A save into a filling tier and into a full one (each save evicting), for every size and
    batch asked: a row each, with both medians (the run fails if a save stores short)."""
    out = bench("saves", "--sizes", "64KiB", "--batches", "1,4", "--dram-mib", "32").stdout
    lines = [line for line in out.splitlines() if line.startswith("| 64 KiB |")]
    assert [line.split("|")[2].strip() for line in lines] == ["1", "4"], out
    for line in lines:
        filling, full = (float(c) for c in line.split("|")[3:5])
        assert filling > 0 and full > 0, out


def test_transports_serves_every_message_over_every_transport_bit_exact(tmp_path: Path) -> None:
    """gRPC, both ZeroMQ servers, both frame servers and the raw floor each answer every message
    (1 block, 2,048 blocks, Stats) alone and with two clients at once, the requests and answers
    the handler's bytes exactly; every row has latencies and calls/s; no socket outlives the run."""
    from tools.bench import transports

    before = set(Path(tempfile.gettempdir()).glob("kvbench-transports-*"))
    out = bench("transports", "--calls", "20", "--warmup", "2", "--runs", "2", "--clients", "2",
                "--out", str(tmp_path)).stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["transports"] == list(transports.TRANSPORTS) and set(res["messages"]) == set(transports.MESSAGES)
    for m in transports.MESSAGES:
        assert res["exact"][m] == dict.fromkeys(transports.TRANSPORTS, True), (m, res["exact"][m])
        assert res["in_process"][m]["p50_us"] > 0
        for t in transports.TRANSPORTS:
            assert len(res["per_run"][m][t]["alone"]) == 2 and len(res["per_run"][m][t]["together"]) == 2
            for mode in ("alone", "together"):
                fig = res["median"][m][t][mode]
                assert 0 < fig["p50_us"] <= fig["p90_us"] <= fig["p99_us"] and fig["calls_per_s"] > 0, (m, t, fig)
    # the Lookup of 2,048 blocks carries their hashes and leased offsets: the messages are the real ones
    assert res["sizes"]["lookup2048"]["request"] > 2048 * 32 and res["sizes"]["lookup2048"]["response"] > 2 * 2048
    # the table a user reads: a section per message, every transport's row in it, bit-exact
    sections = out.split("\n### ")[1:]
    assert len(sections) == len(transports.MESSAGES), out
    for section in sections:
        rows = table_rows(section)
        assert transports.IN_PROCESS in rows, section
        for label in transports.TRANSPORTS.values():
            assert label in rows and rows[label][-1] == "yes" and float(rows[label][0]) > 0, section
    assert set(Path(tempfile.gettempdir()).glob("kvbench-transports-*")) <= before, "sockets left behind"


def test_gpu_without_a_device_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: tools/gpu-check runs this benchmark")
    assert bench("gpu", timeout=120).stdout.strip() == "no CUDA device: nothing to measure"


def test_the_raw_tcp_limit_lands_each_block_in_a_slot_of_its_own() -> None:
    """The cluster benchmark's limit moves what kvstored moves: as many distinct blocks as the run,
    each received into its own slot (as B lands blocks in its arena), not one buffer over and over."""
    from tools.bench import rawtcp
    from tools.bench.common import stop_sender

    size, count = 64 << 10, 6
    proc, port = rawtcp.start(count, size)
    receiver = rawtcp.RawReceiver(port, size, slots=count)
    try:
        assert receiver.run(count, size) > 0
        # the sender stamps block i's first 8 bytes with i
        assert [int.from_bytes(receiver.buf[i * size:i * size + 8], "big") for i in range(count)] == list(range(count))
    finally:
        receiver.close()
        stop_sender(proc)


def test_a_misspelt_subcommand_is_refused_rather_than_starting_the_side_by_side_run() -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "nosuch"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments: nosuch" in proc.stderr, proc.stderr

