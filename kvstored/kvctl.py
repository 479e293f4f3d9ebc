"""``kvctl``: administer a running kvstored daemon through the SDK."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
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


_TIER_COLUMNS = ("capacity", "used", "used %", "blocks", "evictions", "write errors", "read errors")


def _fits(table: Table, console: Console) -> bool:
    """Whether ``table`` prints whole on ``console``: rich squeezes the columns of a table wider
    than the console (headers wrap) and cuts a value that still does not fit to "…", numbers
    included (none of the values kvctl prints has one of its own)."""
    with console.capture() as captured:
        console.print(table)
    return "…" not in captured.get()


def _console() -> Console:
    """stdout's console: a pipe or a log file gets tables at their natural width, neither cut
    to 80 columns nor with values folded over lines (a grep for a node id finds it)."""
    return Console() if sys.stdout.isatty() else Console(width=512)


def render_stats(stats: dict[str, Any], console: Console) -> None:
    title = f"kvstored {stats['version']} — up {_duration(stats['uptime_s'])}"
    rows = []
    for t in stats["tiers"]:
        cap, used = t["capacity_bytes"], t["used_bytes"]
        rows.append((t["name"], _size(cap), _size(used), f"{100 * used / cap:.1f}" if cap else "-",
                     str(t["blocks"]), str(t["evictions"]), str(t["write_errors"]), str(t["read_errors"])))
    tiers = Table(title=title)
    for col in ("tier", *_TIER_COLUMNS):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for row in rows:
        tiers.add_row(*row)
    if not _fits(tiers, console):
        # a narrow terminal (80 columns) and large counters: one column per tier instead
        tiers = Table(title=title)
        tiers.add_column("tier", justify="left")
        for row in rows:
            tiers.add_column(row[0], justify="right")
        for i, name in enumerate(_TIER_COLUMNS, 1):
            tiers.add_row(name, *(row[i] for row in rows))
    console.print(tiers)
    asked, hit = stats["lookup_blocks"], stats["hit_blocks"]
    counters = Table(show_header=False, box=None)
    counters.add_column(justify="left")
    counters.add_column(justify="right")
    for name, value in (
        ("lookups", stats["lookups"]),
        ("blocks asked / hit (lookups and loads)",
         f"{asked} / {hit}" + (f"  ({100 * hit / asked:.1f}%)" if asked else "")),
        ("hit tokens", stats["hit_tokens"]),
        ("saved blocks", stats["saved_blocks"]),
        ("promotions / demotions", f"{stats['promotions']} / {stats['demotions']}"),
        ("dropped blocks", stats["dropped_blocks"]),
        *[(f"  dropped: {reason}", n) for reason, n in sorted(stats.get("dropped_blocks_by_reason", {}).items()) if n],
        ("saves that waited for room", f"{stats.get('room_waits', 0)}  ({stats.get('room_wait_seconds', 0.0):.3f} s "
                                       "in all)"),
        ("index blocks", stats["index_blocks"]),
        ("namespaces", stats["namespaces"]),
        ("active leases", stats["active_leases"]),
        ("clients", stats["clients"]),
        ("peer blocks fetched / served", f"{stats['peer_fetched_blocks']} / {stats['peer_served_blocks']}"),
        ("peer blocks pushed / received", f"{stats['peer_pushed_blocks']} / {stats['peer_received_blocks']}"),
        ("peer failures", stats["peer_failures"]),
    ):
        counters.add_row(name, str(value))
    console.print(counters)


class _Commands(click.Group):
    """The command group: a daemon's refusal or a failed call (any SDK error) is one line on
    stderr and exit status 1, from every command, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KVStoreError as exc:
            click.echo(f"kvctl: {exc}", err=True)
            sys.exit(1)


@click.group(cls=_Commands)
@click.option("--socket", envvar="KVSTORED_SOCKET", default=None,
              help="daemon socket path, or host:port of its server.tcp listener (default: $KVSTORED_SOCKET, "
                   "else the daemon's default socket, as the SDK finds it)")
@click.pass_context
def cli(ctx: click.Context, socket: str | None) -> None:
    """Administer the local kvstored daemon."""
    ctx.obj = socket


def _client(socket: str | None) -> Client:
    return Client(socket, client_name="kvctl")


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
        # a pipe or a log file gets the whole table, not one cut to 80 columns
        render_stats(data, _console())


@cli.command()
@click.option("--model", default="", help="only namespaces of this model (default: all)")
@click.option("--tier", type=click.Choice(["dram", "ssd", "all"]), default="all", show_default=True,
              help="drop copies from this tier (a block with no copy in the other tier leaves the cache); "
                   "'all' removes blocks entirely")
@click.pass_obj
def evict(socket: str | None, model: str, tier: str) -> None:
    """Drop cached blocks (leased blocks stay)."""
    with _client(socket) as client:
        n = client.evict(model, None if tier == "all" else tier)
    where = "the cache (every tier)" if tier == "all" else tier
    click.echo(f"evicted {n} block(s)" + (f" of {model}" if model else "") + f" from {where}")


@cli.command()
@click.option("--model", default="", help="only namespaces of this model (default: all)")
@click.pass_obj
def flush(socket: str | None, model: str) -> None:
    """Write every DRAM block without an SSD copy to the SSD tier now (e.g. before a restart)."""
    written = 0
    with _client(socket) as client, _bar("flushing to ssd") as (bar, task):
        for p in client.flushing(model):
            written = p["written_blocks"]
            bar.update(task, total=written + p["left_blocks"], completed=written)
    click.echo(f"flushed {written} block(s) to ssd")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_obj
def peers(socket: str | None, as_json: bool) -> None:
    """This node and its peers: address, state (up/refused/down/unknown), blocks moved, last error."""
    with _client(socket) as client:
        data = client.peers()
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    if data["membership"] == "off":
        click.echo("peers are off on this node (no peers.listen, peers.static or peers.etcd in its config)")
        return
    table = Table(title=f"node {data['node_id']} — peer channel {data['listen'] or '(not listening)'} — "
                        f"membership {data['membership']}")
    for col in ("node", "address", "state", "fetched", "pushed", "last error"):
        # folded, never cut to "…": a node id or an address is no use with its end missing
        table.add_column(col, justify="right" if col in ("fetched", "pushed") else "left", overflow="fold")
    for p in data["peers"]:
        table.add_row(p["node_id"], p["address"], p["state"], str(p["blocks_fetched"]), str(p["blocks_pushed"]),
                      p["last_error"])
    _console().print(table)


@contextlib.contextmanager
def _bar(description: str) -> Iterator[tuple[Progress, TaskID]]:
    """A progress bar of blocks on stderr (stdout keeps the one-line result)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=False) as bar:
        yield bar, bar.add_task(description, total=None)


def _run_migration(socket: str | None, to: str, model: str, drain: bool) -> None:
    last: dict[str, Any] = {}
    with _client(socket) as client, _bar("draining" if drain else f"migrating to {to}") as (bar, task):
        for p in client.migrate(to, model=model, drain=drain):
            last = p
            bar.update(task, total=p["total_blocks"], completed=p["pushed_blocks"] + p["failed_blocks"])
    click.echo(f"pushed {last.get('pushed_blocks', 0)} of {last.get('total_blocks', 0)} block(s)"
               + (f", dropped {last['dropped_blocks']} local copies" if drain else "")
               + (f"; {last['failed_blocks']} failed: {last['detail']}" if last.get("failed_blocks") else ""))
    if last.get("failed_blocks"):
        sys.exit(1)


@cli.command()
@click.argument("to")
@click.option("--model", default="", help="only namespaces of this model (default: all)")
@click.pass_obj
def migrate(socket: str | None, to: str, model: str) -> None:
    """Copy cached blocks to node TO (parents before children); the local copies stay."""
    _run_migration(socket, to, model, drain=False)


@cli.command()
@click.option("--to", default="", help="one node to drain onto (default: spread over every peer)")
@click.pass_obj
def drain(socket: str | None, to: str) -> None:
    """Empty this node onto its peers before shutdown: push every block, then drop the local
    copies of what the peers still hold. Exits 1 if any block could not be moved (those stay)."""
    _run_migration(socket, to, "", drain=True)


def _prompt_request(text: str, model: str, block_size: int) -> dict[str, Any]:
    """A prompt file as a route request: a JSON request object as is (model and block size
    filled in where it has none), a JSON list of token ids, or token ids separated by spaces,
    commas or newlines."""
    stripped = text.strip()
    if stripped.startswith("{"):
        body = json.loads(stripped)
        if not isinstance(body, dict):
            raise click.UsageError("PROMPT_FILE: expected a JSON object, a JSON list or token ids")
        body.setdefault("model", model)
        return body
    if stripped.startswith("["):
        tokens = json.loads(stripped)
    else:
        try:
            tokens = [int(t) for t in stripped.replace(",", " ").split()]
        except ValueError:
            raise click.UsageError("PROMPT_FILE: expected token ids (integers), a JSON list of them, or a "
                                   "JSON route request") from None
    return {"model": model, "namespace": {"block_size": block_size}, "token_ids": tokens}


@cli.command()
@click.argument("prompt_file", type=click.File("r"))
@click.option("--router", "router_url", envvar="KVSTORED_ROUTER", default="http://127.0.0.1:8300", show_default=True,
              help="the router's HTTP API (router.listen; default also from $KVSTORED_ROUTER)")
@click.option("--model", default="default", show_default=True, help="the namespace's model")
@click.option("--block-size", default=16, show_default=True, help="tokens per block")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def route(prompt_file: Any, router_url: str, model: str, block_size: int, as_json: bool) -> None:
    """Ask the router where PROMPT_FILE (token ids, or a JSON route request; - for stdin) should
    go, and print each candidate's TTFT breakdown."""
    import urllib.error
    import urllib.request

    body = json.dumps(_prompt_request(prompt_file.read(), model, block_size)).encode()
    request = urllib.request.Request(router_url.rstrip("/") + "/v1/route", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer = json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            why = json.load(exc).get("error", exc.reason)
        except ValueError:
            why = exc.reason
        click.echo(f"kvctl: the router refused the request: {why}", err=True)
        sys.exit(1)
    except (urllib.error.URLError, OSError) as exc:
        click.echo(f"kvctl: cannot reach the router at {router_url}: {getattr(exc, 'reason', exc)}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    table = Table(title=f"route: {answer['node']} ({answer['tokens']} tokens, {answer['blocks']} blocks)")
    for col in ("node", "TTFT ms", "queue ms", "prefill ms", "fetch ms", "decode ms", "cached", "local",
                "pulled", "from"):
        table.add_column(col, justify="left" if col in ("node", "from") else "right")
    for c in sorted(answer["candidates"], key=lambda c: c["ttft_s"]):
        mark = " *" if c["node"] == answer["node"] else ""
        table.add_row(c["node"] + mark, *(f"{c[k] * 1e3:.2f}" for k in ("ttft_s", "queue_s", "prefill_s",
                                                                        "fetch_s", "decode_s")),
                      str(c["cached_blocks"]), str(c["local_blocks"]), str(c["pulled_blocks"]),
                      c["pull_from"] or "-")
    _console().print(table)


def main() -> None:
    cli(prog_name="kvctl")


if __name__ == "__main__":
    main()
