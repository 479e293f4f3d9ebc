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
    for col in ("tier", "capacity", "used", "used %", "blocks", "evictions", "write errors", "read errors"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for t in stats["tiers"]:
        cap, used = t["capacity_bytes"], t["used_bytes"]
        tiers.add_row(t["name"], _size(cap), _size(used), f"{100 * used / cap:.1f}" if cap else "-",
                      str(t["blocks"]), str(t["evictions"]), str(t["write_errors"]), str(t["read_errors"]))
    console.print(tiers)
    asked, hit = stats["lookup_blocks"], stats["hit_blocks"]
    counters = Table(show_header=False, box=None)
    counters.add_column(justify="left")
    counters.add_column(justify="right")
    for name, value in (
        ("lookups", stats["lookups"]),
        ("blocks asked / hit", f"{asked} / {hit}" + (f"  ({100 * hit / asked:.1f}%)" if asked else "")),
        ("hit tokens", stats["hit_tokens"]),
        ("saved blocks", stats["saved_blocks"]),
        ("promotions / demotions", f"{stats['promotions']} / {stats['demotions']}"),
        ("dropped blocks", stats["dropped_blocks"]),
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


def _client(socket: str | None) -> Client:
    try:
        return Client(socket, client_name="kvctl")
    except KVStoreError as exc:
        click.echo(f"kvctl: {exc}", err=True)
        sys.exit(1)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_obj
def stats(socket: str | None, as_json: bool) -> None:
    """Per-tier capacity and usage, lookups and hits, leases, clients, uptime."""
    with _client(socket) as client:
        data = client.stats()
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        render_stats(data, Console())


@cli.command()
@click.option("--model", default="", help="only namespaces of this model (default: all)")
@click.option("--tier", type=click.Choice(["dram", "ssd", "all"]), default="all", show_default=True,
              help="drop copies from this tier; 'all' removes blocks entirely")
@click.pass_obj
def evict(socket: str | None, model: str, tier: str) -> None:
    """Drop cached blocks (leased blocks stay)."""
    with _client(socket) as client:
        try:
            n = client.evict(model, None if tier == "all" else tier)
        except KVStoreError as exc:
            click.echo(f"kvctl: {exc}", err=True)
            sys.exit(1)
    click.echo(f"evicted {n} block(s)" + (f" of {model}" if model else "") + f" from {tier}")


@cli.command()
@click.option("--model", default="", help="only namespaces of this model (default: all)")
@click.pass_obj
def flush(socket: str | None, model: str) -> None:
    """Write every DRAM block without an SSD copy to the SSD tier now (e.g. before a restart)."""
    with _client(socket) as client:
        try:
            n = client.flush(model)
        except KVStoreError as exc:
            click.echo(f"kvctl: {exc}", err=True)
            sys.exit(1)
    click.echo(f"flushed {n} block(s) to ssd")


def main() -> None:
    cli(prog_name="kvctl")


if __name__ == "__main__":
    main()
