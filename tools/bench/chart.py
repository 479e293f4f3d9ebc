"""Every chart of the benchmarks, drawn with matplotlib into a PNG:

* ``putget``: the side-by-side run's put/get bars and its lookup and small-call latencies, from its
  ``results.json``;
* ``first-last``: ``python -m tools.bench cluster``'s time to first vs last block per prompt, from
  the ``results.json`` it writes with ``--out``;
* ``tiering``: ``python -m tools.bench tiering``'s TTFT per tier against recomputing, measured next
  to the model;
* ``migration``: ``python -m tools.bench migration``'s TTFT on the decode node, the whole prefix
  pulled after the prefill against blocks pushed as they are computed, measured next to the model;
* ``vllm-ttft``: ``python -m tools.bench vllm``'s TTFT through real vLLM per prompt length and
  source (cold prefill, kvstored's tiers, vLLM's own cache), from the ``results.json`` it writes
  with ``--out``.

``python -m tools.bench.chart KIND results.json chart.png`` draws one. The product's venv need not
have matplotlib (the bench venv has it): :func:`render` runs that command in the first interpreter
that does and says why when none does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.bench import peerenv
from tools.bench.common import REPO_ROOT
from tools.bench.report import MEMCPY, median, putget_rows, size_label


def _pyplot() -> Any:
    # imported here, not at the top: render() runs in interpreters without matplotlib
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def putget(results: dict[str, Any], png: str) -> None:
    """The side-by-side run: GB/s per op, block size and batch for each contender, then lookups
    and small calls (p50 against the 2 ms lookup target)."""
    plt = _pyplot()
    table = putget_rows(results)
    keys = sorted(table, key=lambda k: (-k[1], k[2], k[0] != "get"))
    names: list[str] = []
    for c in results.get("putget", []):
        if c["results"] and c["contender"] not in names:
            names.append(c["contender"])
    if MEMCPY in names:
        names.remove(MEMCPY)
        names.insert(0, MEMCPY)
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 1.6 * len(keys)), 10),
                             gridspec_kw={"height_ratios": [3, 2]})
    ax = axes[0]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for k, row_key in enumerate(keys):
            r = table[row_key].get(name)
            if r is None:
                continue
            m = median(r["gbps"])
            xs.append(k + (i - (len(names) - 1) / 2) * width)
            ys.append(m)
            lo.append(m - min(r["gbps"]))
            hi.append(max(r["gbps"]) - m)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{op} {size_label(s)}\nbatch {b}" for op, s, b in keys], fontsize=8)
    ax.set_ylabel("GB/s (median, min-max)")
    ax.set_title("Put/get of KV blocks, same run")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[1]
    labels, vals, errs = [], [], []
    pre = results.get("prefix")
    if pre:
        for key, label in (("cold", "lookup 32k cold"), ("warm", "lookup 32k warm"),
                           ("by_hash", "lookup 32k by hashes"), ("hash_only", "hash 32k tokens")):
            s = pre[key]["p50_us"]
            labels.append(label)
            vals.append(s["median"])
            errs.append((s["median"] - s["min"], s["max"] - s["median"]))
    for name, s in (results.get("smallcall") or {}).get("calls", {}).items():
        labels.append(name.replace(" (Unix socket, grpc.aio server)", "").replace("kvstored ", ""))
        vals.append(s["p50_us"]["median"])
        errs.append((s["p50_us"]["median"] - s["p50_us"]["min"], s["p50_us"]["max"] - s["p50_us"]["median"]))
    if labels:
        ax.barh(range(len(labels)), vals, xerr=list(zip(*errs)), capsize=2, color="tab:green")
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.axvline(2000, color="red", linestyle="--", linewidth=1, label="2 ms lookup target")
        ax.set_xlabel("p50 µs (median over runs, min-max)")
        ax.set_title("Lookups and small calls")
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    else:
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def first_last(data: dict[str, Any], png: str) -> None:
    """The cluster benchmark: ms to the first and to the last block of a prompt streamed from the
    peer into engine buffers, per prompt size (medians, log scales)."""
    plt = _pyplot()
    ttfb = {int(k): v for k, v in data["ttfb"].items()}
    xs = sorted(ttfb)
    first = [statistics.median(ttfb[x]["first_s"]) * 1e3 for x in xs]
    last = [statistics.median(ttfb[x]["last_s"]) * 1e3 for x in xs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, first, "o-", label="time to first block")
    ax.plot(xs, last, "s-", label="time to last block")
    for x, f, last_ms in zip(xs, first, last):
        ax.annotate(f"{f:.1f} ms", (x, f), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
        ax.annotate(f"{last_ms:.0f} ms", (x, last_ms), textcoords="offset points", xytext=(0, 6), ha="center",
                    fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x // 1024}k" for x in xs])
    ax.set_xlabel(f"prompt tokens (16-token blocks of {data['ttfb_block_bytes'] >> 10} KiB)")
    ax.set_ylabel("ms after the request (median)")
    ax.set_title("Decode node streams a prompt's KV from its peer into engine buffers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def tiering(results: dict[str, Any], png: str) -> None:
    """``python -m tools.bench tiering``: TTFT per tier and prompt length, measured bars next to
    the model's predicted markers."""
    plt = _pyplot()
    med, pred = results["median"], results["predicted"]
    lengths = list(med["fresh"])
    kinds = ["fresh", "dram", "ssd", "peer"]
    labels = {"fresh": "recompute", "dram": "DRAM", "ssd": "SSD", "peer": "peer"}
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [j + (i - 1.5) * width for j in range(len(lengths))]
        ax.bar(xs, [med[kind][n] * 1e3 for n in lengths], width, label=f"{labels[kind]} (measured)")
        ax.scatter(xs, [pred[kind][n] * 1e3 for n in lengths], color="black", marker="_", s=300, zorder=3,
                   label="model" if i == 0 else None)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT, ms")
    ax.set_title("A prompt served from each tier vs recomputed (tiny Llama, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def migration(results: dict[str, Any], png: str) -> None:
    """``python -m tools.bench migration``: TTFT per prompt length, whole prefix against pipelined,
    measured lines next to the model's predicted markers, and the prefill alone."""
    plt = _pyplot()
    lengths = [int(t) for t in results["tokens"]]
    decode_ms = results["decode_s"] * 1e3
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(lengths, [results["prefill_s"][str(n)] * 1e3 for n in lengths], ":", color="grey", label="prefill alone")
    for key, label, marker in (("whole_s", "whole prefix after the prefill", "s"),
                               ("pipelined_s", "pipelined (pushed chunk by chunk)", "o")):
        measured = [statistics.median(results[key][str(n)]) * 1e3 + decode_ms for n in lengths]
        line = ax.plot(lengths, measured, marker + "-", label=f"{label}, measured")[0]
        ax.scatter(lengths, [results["predicted"][key][str(n)] * 1e3 + decode_ms for n in lengths],
                   marker="_", s=400, color=line.get_color(), zorder=3, label=f"{label}, model")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    ax.set_xlabel(f"prompt tokens (16-token blocks of {results['block_bytes'] >> 10} KiB)")
    ax.set_ylabel("TTFT on the decode node, ms (median)")
    ax.set_title(f"Prefill/decode migration ({results['model']} prefill at {results['flops_per_s']:.2g} FLOP/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


VLLM_SOURCES = {"cold": "cold prefill", "dram": "kvstored DRAM", "ssd": "kvstored SSD", "peer": "kvstored peer",
                "vllm": "vLLM's own cache", "lmcache": "LMCache connector"}


def vllm_ttft(results: dict[str, Any], png: str) -> None:
    """``python -m tools.bench vllm``: median TTFT per prompt length and source (log scale), each
    bar labelled with its ratio to the cold prefill of the same length."""
    plt = _pyplot()
    lengths = [str(n) for n in results["tokens"]]
    ttft = results["ttft_s"]
    sources = [s for s in VLLM_SOURCES if all(ttft[n].get(s) for n in lengths)]
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(sources)
    for i, source in enumerate(sources):
        xs = [j + (i - (len(sources) - 1) / 2) * width for j in range(len(lengths))]
        ms = [statistics.median(ttft[n][source]) * 1e3 for n in lengths]
        bars = ax.bar(xs, ms, width, label=VLLM_SOURCES[source])
        for bar, n, value in zip(bars, lengths, ms):
            cold = statistics.median(ttft[n]["cold"]) * 1e3
            label = f"{value:.0f} ms" if source == "cold" else f"{value:.0f} ms\n{value / cold:.3f}x"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, value), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT, ms (median; ratio to cold prefill)")
    # results from before shapes and dtypes were options: the tiny fp32 model
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(results.get("dtype", "float32"), results.get("dtype"))
    ax.set_title(f"TTFT through vLLM {results['vllm']} (CPU, {dtype}): random-weight {results.get('shape', 'tiny')} "
                 f"Llama, hidden {results['hidden']} x {results['layers']} layers, medians of {results['runs']} runs",
                 fontsize=9)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


CHARTS: dict[str, Callable[[dict[str, Any], str], None]] = {"putget": putget, "first-last": first_last,
                                                             "tiering": tiering, "migration": migration,
                                                             "vllm-ttft": vllm_ttft}


def render(kind: str, results_json: Path, png: Path, log: Path | None = None) -> str | None:
    """Draw chart ``kind`` of ``results_json`` into ``png`` with the bench venv's python or this
    one, whichever has matplotlib first; its output goes to ``log``. None once drawn, else why not."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), MPLBACKEND="Agg")
    for py in (str(peerenv.PY), sys.executable):
        if not Path(py).exists():
            continue
        probe = subprocess.run([py, "-c", "import matplotlib"], capture_output=True, timeout=120, env=env)
        if probe.returncode != 0:
            continue
        with open(log or os.devnull, "ab") as fh:
            rc = subprocess.run([py, "-m", "tools.bench.chart", kind, str(results_json), str(png)], stdout=fh,
                                stderr=subprocess.STDOUT, timeout=300, env=env, cwd=REPO_ROOT).returncode
        return None if rc == 0 else f"chart failed{f' (see {log})' if log else ''}"
    return "matplotlib is not installed (a full run of python -m tools.bench installs it into .bench/venv)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.chart",
                                description="Draw one of the benchmarks' charts into a PNG (needs matplotlib).")
    p.add_argument("kind", choices=sorted(CHARTS))
    p.add_argument("results_json")
    p.add_argument("png")
    a = p.parse_args(argv)
    CHARTS[a.kind](json.loads(Path(a.results_json).read_text()), a.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
