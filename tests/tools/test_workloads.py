"""The workload generator (tools/workloads): deterministic, in the conversation trace's format,
chained like prefix hashes, and each shape with the property it is named for, measured on a small
generated trace; the trace replay takes its traces from a file or in-process."""

from __future__ import annotations

import collections
import itertools
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstored.policy.registry import POLICIES
from tools import trace_replay
from tools.workloads import SHAPES, generate, summarize
from tools.workloads.blocks import BlockIds
from tools.workloads.shapes import Agent, Chat, FewShot

ROOT = Path(__file__).resolve().parents[2]
B = 512
N = 2000
Records = list[dict[str, Any]]
SUMMARY = re.compile(r"^([\d,]+) requests, ([\d,]+) unique full blocks, infinite-cache block hit ratio ([\d.]+), "
                     r"median prompt ([\d,]+) tokens$")


@pytest.fixture(scope="module")
def traces() -> dict[str, Records]:
    return {shape: generate(shape, N, seed=7) for shape in SHAPES}


def _full(record: dict[str, Any]) -> list[int]:
    return record["hash_ids"][: record["input_length"] // B]


def _follow_ups(records: Records) -> dict[int, int]:
    """Request index -> the latest earlier request whose full blocks this one starts with, all of
    them, up to one that leads to no other full block than this session's: a block shared by
    several sessions (a system prompt, an agent's prefix) names no one request."""
    successors: dict[int, set[int]] = collections.defaultdict(set)
    for r in records:
        full = _full(r)
        for a, b in itertools.pairwise(full):
            successors[a].add(b)
    last_of: dict[int, int] = {}    # a request's last full block -> that request
    parents = {}
    for i, r in enumerate(records):
        full = _full(r)
        for k in range(len(full) - 1, -1, -1):
            if full[k] in last_of and len(successors[full[k]]) <= 1:
                parents[i] = last_of[full[k]]
                break
        if full:
            last_of[full[-1]] = i
    return parents


def _cached_prefix(records: Records) -> list[int]:
    """Per request: how many of its leading full blocks an earlier request already had."""
    seen: set[int] = set()
    out = []
    for r in records:
        full = _full(r)
        hit = 0
        while hit < len(full) and full[hit] in seen:
            hit += 1
        out.append(hit)
        seen.update(full)
    return out


# -- every shape ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_same_seed_gives_the_same_trace(shape: str) -> None:
    assert generate(shape, 300, seed=1) == generate(shape, 300, seed=1)
    assert generate(shape, 300, seed=1) != generate(shape, 300, seed=2)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "mix"])
def test_fewer_requests_are_the_first_of_more(shape: str) -> None:
    """A trace is the first N requests by arrival of the sessions drawn: asking for fewer gives a
    prefix of the same trace (a session started later can add nothing among them)."""
    assert generate(shape, 400, seed=3) == generate(shape, 900, seed=3)[:400]


@pytest.mark.parametrize("block_tokens", [B, 256])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_records_have_the_conversation_trace_format(shape: str, block_tokens: int) -> None:
    records = generate(shape, 500, seed=4, block_tokens=block_tokens)
    assert len(records) == 500
    for r in records:
        assert list(r) == ["timestamp", "input_length", "output_length", "hash_ids"]
        assert all(type(r[k]) is int for k in ("timestamp", "input_length", "output_length"))
        assert r["input_length"] >= 1 and r["output_length"] >= 1
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / block_tokens)
        assert all(type(h) is int and h >= 0 for h in r["hash_ids"])
    times = [r["timestamp"] for r in records]
    assert times[0] == 0 and times == sorted(times) and times[-1] > 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_block_ids_are_chained_and_partial_blocks_never_repeat(shape: str, traces: dict[str, Records]) -> None:
    records = traces[shape]
    where: dict[int, tuple[int, int]] = {}   # id -> (position, the id before it)
    count: collections.Counter[int] = collections.Counter()
    expected_next = 0
    for r in records:
        ids = r["hash_ids"]
        for pos, h in enumerate(ids):
            # one position and one predecessor per id: by induction, two requests sharing an id
            # share every id before it
            assert where.setdefault(h, (pos, ids[pos - 1] if pos else -1)) == (pos, ids[pos - 1] if pos else -1)
            if h >= expected_next:   # ids are numbered in order of first appearance
                assert h == expected_next
                expected_next += 1
        count.update(ids)
    partial = [r["hash_ids"][-1] for r in records if r["input_length"] % B]
    assert partial and all(count[h] == 1 for h in partial)


def test_block_ids_follow_the_tokens_not_the_segments() -> None:
    ids = BlockIds(4)
    a = ids.chain([(1, 6), (2, 3)])          # blocks: 1111 | 11 22 | 2
    b = ids.chain([(1, 6), (2, 2), (3, 5)])  # 1111 | 11 22 | 3333 | 3
    c = ids.chain([(1, 5), (2, 4)])          # 1111 | 1 222 | 2
    assert a[:2] == b[:2] and a[2] != b[2]
    assert c[0] == a[0] and c[1] != a[1]
    assert ids.chain([(1, 6), (2, 2)]) == a[:2]   # a whole number of blocks: no partial id
    again = ids.chain([(1, 6), (2, 3)])
    assert again[:2] == a[:2] and again[2] != a[2]   # the same partial tail gets a fresh id


# -- each shape's defining property --------------------------------------------------------------
def test_chat_later_turns_extend_the_previous_prompt_by_its_reply(traces: dict[str, Records]) -> None:
    records = traces["chat"]
    parents = _follow_ups(records)
    assert 0.15 < len(parents) / len(records) < 0.45   # the conversation trace: 0.27
    for child, parent in parents.items():
        p, c = records[parent], records[child]
        assert c["input_length"] > p["input_length"] + p["output_length"]
        assert c["timestamp"] > p["timestamp"]
    gaps = [(records[c]["timestamp"] - records[p]["timestamp"]) / 1000 for c, p in parents.items()]
    assert 60 < statistics.median(gaps) < 240   # a median of about 2 minutes
    assert len({r["hash_ids"][0] for r in records}) <= Chat().system_prompts


def test_chat_another_turn_is_likelier_the_longer_a_conversation_went_on() -> None:
    records = generate("chat", 6000, seed=7)   # half an hour: enough conversations reach turn 3
    parents = _follow_ups(records)
    turn = [1] * len(records)
    for child in sorted(parents):
        turn[child] = turn[parents[child]] + 1
    # counted on requests with 10 minutes of trace after them, in which nearly all follow-ups come
    end = records[-1]["timestamp"] - 600_000
    followed = collections.Counter(turn[p] for p in set(parents.values()) if records[p]["timestamp"] < end)
    asked = collections.Counter(turn[i] for i, r in enumerate(records) if r["timestamp"] < end)
    first = followed[1] / asked[1]
    later = sum(followed[t] for t in asked if t >= 3) / sum(asked[t] for t in asked if t >= 3)
    assert first < 0.3 and later > 0.4   # defaults: 0.25, then 0.49, 0.57, 0.63 ...
    assert len({r["hash_ids"][0] for r in records}) <= Chat().system_prompts


def _doc(record: dict[str, Any]) -> int:
    # the default system prompt is shorter than a block: the first block names the document
    return int(record["hash_ids"][0])


def test_docqa_long_prompts_and_a_zipf_head() -> None:
    records = generate("docqa", N, seed=7, drift_s=0)   # no drift: the head holds still
    assert 9_000 < statistics.median(r["input_length"] for r in records) < 14_000
    counts = collections.Counter(_doc(r) for r in records)
    head = sum(c for _, c in counts.most_common(10)) / len(records)
    assert 0.25 < head < 0.42   # Zipf(1) over 5,000 documents: 0.32


def test_docqa_popularity_drifts_and_reuse_comes_minutes_later(traces: dict[str, Records]) -> None:
    records = traces["docqa"]
    assert 9_000 < statistics.median(r["input_length"] for r in records) < 14_000
    third = len(records) // 3
    early = collections.Counter(_doc(r) for r in records[:third])
    late = collections.Counter(_doc(r) for r in records[-third:])
    hot = [d for d, _ in early.most_common(10)]
    assert sum(early[d] for d in hot) / third > 0.15
    assert sum(late[d] for d in hot) / third < 0.03   # the hottest documents went cold
    last: dict[int, int] = {}
    gaps = []
    for r in records:
        if (d := _doc(r)) in last:
            gaps.append((r["timestamp"] - last[d]) / 1000)
        last[d] = r["timestamp"]
    assert len(gaps) > len(records) / 3 and statistics.quantiles(gaps, n=4)[2] > 100


def test_agent_turns_come_seconds_apart_behind_a_long_shared_prefix(traces: dict[str, Records]) -> None:
    records = traces["agent"]
    parents = _follow_ups(records)
    assert len(parents) / len(records) > 0.8   # most requests are a later turn of a loop
    gaps = [(records[c]["timestamp"] - records[p]["timestamp"]) / 1000 for c, p in parents.items()]
    assert statistics.median(gaps) < 10
    for child, parent in parents.items():
        assert records[child]["input_length"] > records[parent]["input_length"] + records[parent]["output_length"]
    prefix = _cached_prefix(records)
    assert statistics.median(prefix) >= 8   # at least 4k tokens already cached
    assert sum(1 for h in prefix if h >= 7) / len(records) > 0.95   # the agents' prefixes, 4-8k tokens
    assert len({tuple(r["hash_ids"][:7]) for r in records}) <= Agent().agents


def test_fewshot_short_shared_templates_with_distinct_suffixes(traces: dict[str, Records]) -> None:
    records = traces["fewshot"]
    assert len({r["hash_ids"][0] for r in records}) <= FewShot().templates
    prefix = _cached_prefix(records)
    assert sum(1 for h in prefix if h >= 1) / len(records) > 0.95
    assert max(prefix) <= 5   # templates of 1-2k tokens: at most a few blocks shared
    count = collections.Counter(h for r in records for h in r["hash_ids"])
    repeated = {h for h, c in count.items() if c > 1}
    assert len(repeated) <= 5 * FewShot().templates
    for r in records:   # past the template every block is the request's own
        assert not repeated & set(r["hash_ids"][5:]), r


def test_scan_reuses_nothing(traces: dict[str, Records]) -> None:
    records = traces["scan"]
    ids = [h for r in records for h in r["hash_ids"]]
    assert len(ids) == len(set(ids))
    assert summarize(records).hit_ratio == 0.0


def test_mix_interleaves_its_shapes_by_weight() -> None:
    records = generate("mix", N, seed=5, weights={"fewshot": 1, "scan": 1})
    templates = collections.Counter(r["hash_ids"][0] for r in records)
    is_fewshot = [templates[r["hash_ids"][0]] > 1 for r in records]
    for part in (is_fewshot[: N // 2], is_fewshot[N // 2 :]):   # both all along, half each
        assert 0.4 < sum(part) / len(part) < 0.6
    # a component keeps its own parameters
    records = generate("mix", 500, seed=5, weights={"docqa": 1}, **{"docqa.documents": 3})
    assert len({_doc(r) for r in records}) == 3


def test_bad_parameters_are_refused() -> None:
    for shape, params in (("chat", {"bogus": 1}), ("chat", {"rate": 0}), ("docqa", {"documents": 0}),
                          ("mix", {"weights": {"nope": 1}}), ("mix", {"weights": {"chat": 0}}),
                          ("scan", {"chat.rate": 1})):
        with pytest.raises(ValueError):
            generate(shape, 10, seed=0, **params)
    with pytest.raises(ValueError):
        generate("nope", 10, seed=0)
    # zero is a chance, a spread or no drift, not a mistake: conversations of one turn
    records = generate("chat", 300, seed=0, continue_first=0, continue_max=0, gap_sigma=0)
    assert _follow_ups(records) == {}


@pytest.mark.parametrize(("shape", "duration_s"), [("scan", 100), ("mix", 300), ("chat", 600), ("agent", 600)])
def test_duration_sets_the_arrival_rate(shape: str, duration_s: float) -> None:
    records = generate(shape, 1000, seed=2, duration_s=duration_s)
    assert 0.95 < records[-1]["timestamp"] / 1000 / duration_s < 1.05


# -- command lines -------------------------------------------------------------------------------
def test_the_command_writes_what_generate_returns(tmp_path: Path) -> None:
    out = tmp_path / "chat.jsonl"
    proc = subprocess.run([sys.executable, "-m", "tools.workloads", "chat", "--requests", "200", "--seed", "3",
                           "--out", str(out), "--rate", "5", "--gap-s=30"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == generate("chat", 200, seed=3, rate=5.0, gap_s=30.0)
    m = SUMMARY.match(proc.stdout.strip())
    assert m is not None, proc.stdout
    summary = summarize(records)
    assert int(m.group(1).replace(",", "")) == 200 and int(m.group(2).replace(",", "")) == summary.unique_blocks
    assert float(m.group(3)) == pytest.approx(summary.hit_ratio, abs=1e-3)
    bad = subprocess.run([sys.executable, "-m", "tools.workloads", "chat", "--requests", "5", "--out", str(out),
                          "--turns", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no parameter 'turns'" in bad.stderr


def _rows(text: str) -> list[tuple[str, str, str]]:
    """(capacity, policy, hit tokens) of each row of the replay's table."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0].endswith("%"):
            rows.append((cells[0], cells[2].replace("**", "").replace(" (default)", ""), cells[3]))
    return rows


def test_the_replay_runs_a_shape_in_process_and_from_a_written_file(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--capacities", "10,50", "--policies", ",".join(POLICIES)]
    shape = ["--shape", "docqa", "--requests", "300", "--seed", "4", "--param", "documents=40"]
    assert trace_replay.main([*shape, *args]) == 0
    in_process = _rows(capsys.readouterr().out)
    assert {(cap, policy) for cap, policy, _ in in_process} == {
        (cap, policy) for cap in ("10%", "50%") for policy in ("per-block LRU", *POLICIES, "offline bound")}
    path = tmp_path / "docqa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in generate("docqa", 300, seed=4, documents=40)))
    assert trace_replay.main(["--trace", str(path), *args]) == 0
    assert _rows(capsys.readouterr().out) == in_process
    for bad in (["--param", "documents=4"], ["--shape", "chat", "--param", "documents=4"],
                ["--shape", "chat", "--trace", str(path)]):
        with pytest.raises(SystemExit) as exit_:
            trace_replay.main(bad)
        assert exit_.value.code == 2
