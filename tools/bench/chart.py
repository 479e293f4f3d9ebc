"""``python -m tools.bench.chart results.json chart.png`` (needs matplotlib: the bench venv has it)."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tools.bench.report import MEMCPY, _med, _size, putget_rows


def main() -> int:
    results = json.loads(open(sys.argv[1]).read())
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
        for k, key in enumerate(keys):
            r = table[key].get(name)
            if r is None:
                continue
            m = _med(r["gbps"])
            xs.append(k + (i - (len(names) - 1) / 2) * width)
            ys.append(m)
            lo.append(m - min(r["gbps"]))
            hi.append(max(r["gbps"]) - m)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{op} {_size(s)}\nbatch {b}" for op, s, b in keys], fontsize=8)
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
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
