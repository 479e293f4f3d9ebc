"""Chart of time to first vs last block from ``tools/bench_cluster.py --json`` output (needs
matplotlib; ``.bench/venv`` has it): ``python tools/bench_cluster_chart.py results.json chart.png``."""

from __future__ import annotations

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str, dst: str) -> int:
    data = json.loads(open(src).read())
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
    fig.savefig(dst, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
