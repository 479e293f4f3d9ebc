"""tools.route_sim runs end to end on a small synthetic trace (speed is never asserted), and its
policies behave as documented where that is exact."""

from __future__ import annotations

import json
from pathlib import Path

from tools.route_sim.__main__ import main
from tools.route_sim.scale import main as scale_main


def _trace(path: Path) -> Path:
    rows = []
    for i in range(120):
        system = [0, 1, 2]                       # a shared system prompt
        own = [1000 + (i % 10) * 10 + j for j in range(3)]   # ten conversations, each reused
        rows.append({"timestamp": i * 200, "input_length": 512 * 6 + 100, "output_length": 50,
                     "hash_ids": [*system, *own, 99999 + i]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_every_policy_runs_and_the_table_has_a_row_each(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "results.json"
    assert main(["--trace", str(_trace(tmp_path / "t.jsonl")), "--nodes", "2,4", "--capacity", "50",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results) == 14 and {r["policy"] for r in results} == {
        "round-robin", "least-loaded", "sglang", "dynamo", "llm-d", "kvstored", "oracle"}
    for r in results:
        assert r["mean_ttft_s"] > 0 and 0 <= r["hit_rate"] <= 1 and r["imbalance"] >= 1
    assert capsys.readouterr().out.count("| conversation |") == 14
    # every conversation's prefix is cached somewhere after its first turn: the oracle finds it
    oracle = next(r for r in results if r["policy"] == "oracle" and r["nodes"] == 2)
    assert oracle["hit_rate"] > 0.5


def test_the_scale_figures_run(capsys) -> None:  # type: ignore[no-untyped-def]
    assert scale_main(["--entries", "20000", "--nodes", "4", "--runs", "3", "--events", "5000"]) == 0
    text = capsys.readouterr().out
    assert "events/s on one core" in text and "B per (block, node) entry" in text and "32k-token prompt" in text


def test_the_live_run_routes_real_requests_through_three_daemons(capsys) -> None:  # type: ignore[no-untyped-def]
    import pytest

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.route_live import main as live_main

    assert live_main(["--conversations", "2", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| kvstored router", "| round robin"))]
    assert len(rows) == 2, out
    # the second turn of each conversation finds its first turn on the node the router chose
    assert float(rows[0].split("|")[4].strip().rstrip("%")) > 0, out
