"""``kvctl``: administer a running kvstored daemon through the SDK."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from kvstored_client import Client, KVStoreError


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def render_stats(stats: dict[str, Any], console: Console) -> None:
    tiers = Table(title=f"kvstored {stats['version']} — up {_duration(stats['uptime_s'])}")
    for col in ("tier", "capacity", "used", "used %", "blocks", "evictions"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for t in stats["tiers"]:
        cap, used = int(t["capacity_bytes"]), int(t["used_bytes"])
        tiers.add_row(t["name"], _size(cap), _size(used), f"{100 * used / cap:.1f}" if cap else "-",
                      str(t["blocks"]), str(t["evictions"]))
    console.print(tiers)
    lookups, asked, hit = int(stats["lookups"]), int(stats["lookup_blocks"]), int(stats["hit_blocks"])
    counters = Table(show_header=False, box=None)
    counters.add_column(justify="left")
    counters.add_column(justify="right")
    for name, value in (
        ("lookups", lookups),
        ("blocks asked / hit", f"{asked} / {hit}" + (f"  ({100 * hit / asked:.1f}%)" if asked else "")),
        ("hit tokens", stats["hit_tokens"]),
        ("saved blocks", stats["saved_blocks"]),
        ("index blocks", stats["index_blocks"]),
        ("namespaces", stats["namespaces"]),
        ("active leases", stats["active_leases"]),
        ("clients", stats["clients"]),
    ):
        counters.add_row(name, str(value))
    console.print(counters)


@click.group()
@click.option("--socket", envvar="KVSTORED_SOCKET", default=None,
              help="daemon socket (default: the daemon's default location)")
@click.pass_context
def cli(ctx: click.Context, socket: str | None) -> None:
    """Administer the local kvstored daemon."""
    ctx.obj = socket


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_obj
def stats(socket: str | None, as_json: bool) -> None:
    """Per-tier capacity and usage, lookups and hits, leases, clients, uptime."""
    try:
        with Client(socket, client_name="kvctl") as client:
            data = client.stats()
    except KVStoreError as exc:
        click.echo(f"kvctl: {exc}", err=True)
        sys.exit(1)
    for key in ("lookups", "lookup_blocks", "hit_blocks", "hit_tokens", "saved_blocks", "active_leases",
                "clients", "namespaces", "index_blocks"):
        data[key] = int(data[key])  # protobuf JSON writes 64-bit integers as strings
    for tier in data["tiers"]:
        for key in ("capacity_bytes", "used_bytes", "blocks", "evictions"):
            tier[key] = int(tier[key])
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        render_stats(data, Console())


def main() -> None:
    cli(prog_name="kvctl")


if __name__ == "__main__":
    main()
