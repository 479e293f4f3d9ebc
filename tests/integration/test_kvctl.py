"""`kvctl stats`: a readable table and --json, against a real daemon."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

import kvstored
from kvstored import kvctl as kvctl_mod


def kvctl(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "kvstored.kvctl", "--socket", socket, *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_stats_table_and_json(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket) as c:
        c.save(np.arange(64), np.ones((4, 2048), np.uint8))
        c.lookup(np.arange(80))
        out = kvctl(daemon.socket, "stats")
        assert out.returncode == 0, out.stderr
        for needle in ("dram", "64.0 MiB", "8.0 KiB", "hit tokens", "64", "active leases", "clients",
                       f"kvstored {kvstored.__version__}", "up 00:00:"):
            assert needle in out.stdout, (needle, out.stdout)
        data = json.loads(kvctl(daemon.socket, "stats", "--json").stdout)
    assert data["tiers"][0] == {"name": "dram", "capacity_bytes": 64 << 20, "used_bytes": 4 * 2048,
                                "blocks": 4, "evictions": 0, "write_errors": 0, "read_errors": 0}
    assert data["tiers"][1]["name"] == "ssd" and data["tiers"][1]["capacity_bytes"] == 256 << 20
    assert data["hit_tokens"] == 64 and data["lookups"] == 1 and data["saved_blocks"] == 4
    assert data["clients"] == 1  # the SDK client above; kvctl itself opens no session


def test_stats_without_daemon_says_how_to_start(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = kvctl(str(tmp_path / "none.sock"), "stats")
    assert out.returncode == 1
    assert "Start one with `kvstored`" in out.stderr
    assert "`kvctl --socket`" in out.stderr   # it named only KVSTORED_SOCKET and Client(socket=...)


def test_a_daemon_that_accepts_but_does_not_answer_yet_is_not_reported_as_none(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A daemon still starting (pre-faulting its arena, restoring a large SSD index: minutes) has
    its socket listening before it serves: kvctl said "no kvstored daemon answers ... Start one
    with `kvstored`", sending the operator to start a second daemon (which refuses: the socket
    is taken) while ``systemctl status`` showed the first one restoring."""
    import socket as sockets

    path = str(tmp_path / "starting.sock")
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(16)   # connections queue; nothing ever answers them
        out = kvctl(path, "stats")
        with pytest.raises(kvstored.DaemonNotRunning) as raised:
            kvstored.Client(path)
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr
    for text in (out.stderr, str(raised.value)):
        assert "did not answer" in text and "starting" in text, text
        assert "Start one" not in text, text


# -- cluster commands: peers, migrate, drain -------------------------------------------------------
PEER_BLOCK = 16 << 10


def _two_nodes(daemon_factory):  # type: ignore[no-untyped-def]
    """Daemons "a" and "b" on loopback peer ports, each in the other's static list."""
    import socket

    socks = [socket.socket(), socket.socket()]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    pa, pb = (int(s.getsockname()[1]) for s in socks)
    for s in socks:
        s.close()
    static = f"a=127.0.0.1:{pa},b=127.0.0.1:{pb}"
    common = ("--set", f"peers.static={static}", "--set", "peers.token=kvctl-t0ken", "--set", "peers.deadline_s=10")
    a = daemon_factory("--set", f"peers.listen=127.0.0.1:{pa}", "--set", "peers.node_id=a", *common)
    b = daemon_factory("--set", f"peers.listen=127.0.0.1:{pb}", "--set", "peers.node_id=b", *common)
    return a, b


def _ns(model: str) -> kvstored.Namespace:
    return kvstored.Namespace(model=model, block_bytes=PEER_BLOCK)


def _kv(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size=(n, PEER_BLOCK), dtype=np.uint8)


def _tokens(n_blocks: int, start: int) -> list[int]:
    return list(range(start, start + 16 * n_blocks))


def test_peers_when_peers_are_off(daemon) -> None:  # type: ignore[no-untyped-def]
    out = kvctl(daemon.socket, "peers")
    assert out.returncode == 0, out.stderr
    assert "peers are off" in out.stdout
    data = json.loads(kvctl(daemon.socket, "peers", "--json").stdout)
    assert data["membership"] == "off" and data["peers"] == []
    for args in (("migrate", "b"), ("drain",)):
        out = kvctl(daemon.socket, *args)
        assert out.returncode == 1 and "peers are off" in out.stderr, (args, out.stdout, out.stderr)


def test_peers_lists_both_nodes(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    a, _b = _two_nodes(daemon_factory)
    out = kvctl(a.socket, "peers")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "node a" in out.stdout and "membership static" in out.stdout
    row_a = next(line for line in lines if " a " in line and "self" in line)
    row_b = next(line for line in lines if " b " in line and "127.0.0.1:" in line)
    assert "up" in row_b and "self" not in row_b and row_a != row_b
    data = json.loads(kvctl(a.socket, "peers", "--json").stdout)
    assert data["node_id"] == "a" and data["membership"] == "static" and data["listen"].startswith("127.0.0.1:")
    view = {p["node_id"]: p for p in data["peers"]}
    assert set(view) == {"a", "b"}
    assert view["a"]["state"] == "self" and view["a"]["address"] == data["listen"]
    assert view["b"]["state"] == "up" and view["b"]["last_error"] == ""
    assert int(view["b"]["blocks_fetched"]) == 0 and int(view["b"]["blocks_pushed"]) == 0


def test_migrate_copies_one_model_to_the_peer(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_nodes(daemon_factory)
    m, other = _ns("M"), _ns("other-model")
    prompts = {i: (_tokens(5, 100_000 * (i + 1)), _kv(5, i)) for i in range(2)}
    with kvstored.Client(a.socket) as ca, kvstored.Client(b.socket) as cb:
        for tokens, kv in prompts.values():
            ca.save(tokens, kv, namespace=m)
        ca.save(_tokens(3, 900_000), _kv(3, 9), namespace=other)
        out = kvctl(a.socket, "migrate", "b", "--model", "M")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "pushed 10 of 10 block(s)" in out.stdout, out.stdout
        for tokens, kv in prompts.values():
            assert np.array_equal(cb.load(tokens, namespace=m).data, kv)   # b serves them now
            assert ca.lookup(tokens, namespace=m).blocks == 5             # a keeps its copies
        assert cb.lookup(_tokens(3, 900_000), namespace=other).blocks == 0
        assert ca.stats()["peer_pushed_blocks"] == 10 and cb.stats()["peer_received_blocks"] == 10
        peers = {p["node_id"]: p for p in ca.peers()["peers"]}
        assert int(peers["b"]["blocks_pushed"]) == 10
        again = kvctl(a.socket, "migrate", "b", "--model", "M")   # nothing new: still a clean exit
        assert again.returncode == 0 and "of 10 block(s)" in again.stdout, again.stdout + again.stderr


def test_drain_empties_the_node_onto_its_peer(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_nodes(daemon_factory)
    m, other = _ns("M"), _ns("other-model")
    trunk = _tokens(4, 0)
    saved = [(trunk, _kv(4, 1), m),
             (trunk[:32] + _tokens(2, 700_000), np.concatenate([_kv(4, 1)[:2], _kv(2, 2)]), m),   # a branch
             (_tokens(3, 900_000), _kv(3, 3), other)]
    with kvstored.Client(a.socket) as ca, kvstored.Client(b.socket) as cb:
        for tokens, kv, ns in saved:
            ca.save(tokens, kv, namespace=ns)
        assert ca.stats()["index_blocks"] == 9
        out = kvctl(a.socket, "drain")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "pushed 9 of 9 block(s), dropped 9 local copies" in out.stdout, out.stdout
        assert ca.stats()["index_blocks"] == 0
        for tokens, kv, ns in saved:
            assert ca.lookup(tokens, namespace=ns).blocks == 0
            assert np.array_equal(cb.load(tokens, namespace=ns).data, kv)
        empty = kvctl(a.socket, "drain", "--to", "b")            # nothing left: still fine
        assert empty.returncode == 0 and "pushed 0 of 0 block(s)" in empty.stdout, empty.stdout + empty.stderr


def test_migrate_to_an_unknown_peer_fails(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_nodes(daemon_factory)
    with kvstored.Client(a.socket) as ca:
        ca.save(_tokens(2, 0), _kv(2, 0), namespace=_ns("M"))
    out = kvctl(a.socket, "migrate", "nobody")
    assert out.returncode == 1
    assert "unknown peer" in out.stderr and "nobody" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    out = kvctl(a.socket, "drain", "--to", "nobody")
    assert out.returncode == 1 and "unknown peer" in out.stderr, out.stderr
    with kvstored.Client(a.socket) as ca, kvstored.Client(b.socket) as cb:
        assert ca.lookup(_tokens(2, 0), namespace=_ns("M")).blocks == 2       # nothing moved or dropped
        assert cb.stats()["index_blocks"] == 0


def test_peers_json_counts_are_numbers(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    a, _b = _two_nodes(daemon_factory)
    data = json.loads(kvctl(a.socket, "peers", "--json").stdout)
    for p in data["peers"]:
        assert isinstance(p["blocks_fetched"], int) and isinstance(p["blocks_pushed"], int), p


def test_an_unknown_model_is_an_error_not_a_silent_no_op(daemon) -> None:  # type: ignore[no-untyped-def]
    """Regression: ``evict``/``flush --model`` with a mistyped model printed "0 block(s)", exit 0."""
    with kvstored.Client(daemon.socket) as c:
        c.save(list(range(32)), np.ones((2, 1024), np.uint8), namespace=kvstored.Namespace(model="real"))
        with pytest.raises(kvstored.NotFound, match="no namespace of model 'reel'.*'real'"):
            c.evict(model="reel")
    for command in ("evict", "flush"):
        out = subprocess.run([sys.executable, "-m", "kvstored.kvctl", "--socket", daemon.socket, command,
                              "--model", "reel"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "no namespace of model 'reel'" in out.stderr, out


def test_evicting_the_ssd_tier_of_a_node_without_one_is_an_error(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """`kvctl evict --tier ssd` on a node with ``ssd.enabled = false`` said "evicted 0 block(s)
    from ssd" and exited 0, as if the tier had been emptied (`kvctl flush` there is an error)."""
    d = daemon_factory("--set", "ssd.enabled=false")
    with kvstored.Client(d.socket) as c:
        c.save(list(range(32)), np.ones((2, 1024), np.uint8))
        with pytest.raises(kvstored.FailedPrecondition, match="SSD tier is disabled"):
            c.evict(tier="ssd")
        out = kvctl(d.socket, "evict", "--tier", "ssd")
        assert out.returncode == 1 and "SSD tier is disabled" in out.stderr, out
        assert c.lookup(list(range(32))).blocks == 2                 # nothing was dropped
        assert "evicted 2 block(s) from dram" in kvctl(d.socket, "evict", "--tier", "dram").stdout


def test_kvctl_reaches_the_tcp_listener_by_host_and_port(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Regression: ``--socket 127.0.0.1:PORT`` was taken for a Unix path ("no daemon answers")."""
    import socket as sockets

    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon_factory("--tcp", f"127.0.0.1:{port}")
    out = subprocess.run([sys.executable, "-m", "kvstored.kvctl", "--socket", f"127.0.0.1:{port}", "stats", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["version"] == kvstored.__version__


def test_a_peer_back_up_shows_no_stale_error(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Regression: ``kvctl peers`` kept showing "connection refused" for a peer that was up again."""
    from conftest import wait_serving

    a, b = _two_nodes(daemon_factory)
    b.stop()
    down = {p["node_id"]: p for p in json.loads(kvctl(a.socket, "peers", "--json").stdout)["peers"]}
    assert down["b"]["state"] == "down" and down["b"]["last_error"]
    with open(b.log_path, "ab") as log:
        b.proc = subprocess.Popen(b.args, stdout=log, stderr=subprocess.STDOUT)
    wait_serving(b.socket, b.proc)
    up = {p["node_id"]: p for p in json.loads(kvctl(a.socket, "peers", "--json").stdout)["peers"]}
    assert up["b"]["state"] == "up" and up["b"]["last_error"] == ""


def test_a_call_that_fails_after_connecting_is_one_line_and_exit_1(daemon, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every command, not only those that caught it: `kvctl stats` against a daemon that stops
    answering after the handshake printed a traceback."""
    from click.testing import CliRunner

    from kvstored import kvctl as kvctl_mod

    def fail(self):  # type: ignore[no-untyped-def]
        raise kvstored.DeadlineExceeded("kvstored did not answer within 30 s")

    monkeypatch.setattr(kvstored.Client, "stats", fail)
    out = CliRunner().invoke(kvctl_mod.cli, ["--socket", daemon.socket, "stats"])
    assert out.exit_code == 1, out.output
    assert out.stderr.strip() == "kvctl: kvstored did not answer within 30 s"
    assert out.exception is None or isinstance(out.exception, SystemExit)


# -- the tables, rendered without a daemon: what an operator reads must be whole ----------------
COUNTERS = ("lookups", "lookup_blocks", "hit_blocks", "hit_tokens", "saved_blocks", "promotions", "demotions",
            "dropped_blocks", "index_blocks", "namespaces", "active_leases", "clients", "peer_fetched_blocks",
            "peer_served_blocks", "peer_pushed_blocks", "peer_received_blocks", "peer_failures")


def _stats(blocks: int, evictions: int) -> dict[str, Any]:
    tier = {"capacity_bytes": 3 << 40, "used_bytes": 1 << 40, "blocks": blocks, "evictions": evictions,
            "write_errors": 123456, "read_errors": 654321}
    return {"version": kvstored.__version__, "uptime_s": 1e6,
            "tiers": [{"name": "dram", **tier}, {"name": "ssd", **tier}], **dict.fromkeys(COUNTERS, 7),
            "dropped_blocks_by_reason": {"refused": 5, "write_error": 2, "ssd_full": 0},
            "room_waits": 31, "room_wait_seconds": 1.25}


@pytest.mark.parametrize("width", [80, 120])
def test_stats_counters_are_never_cut_to_fit_the_terminal(width: int) -> None:
    """An 80-column terminal squeezed the tier table: "evictio…" as a header even for a new node,
    and a long-running node's counters cut, "1234567…" for 123456789 blocks and "987654…" for
    9876543210 evictions."""
    out = io.StringIO()
    kvctl_mod.render_stats(_stats(123456789, 9876543210), Console(file=out, width=width))
    text = out.getvalue()
    assert "…" not in text, text
    for value in ("123456789", "9876543210", "123456", "654321", "3.0 TiB", "1.0 TiB", "33.3"):
        assert value in text, (value, text)
    for name in ("evictions", "write errors", "read errors", "dram", "ssd", "dropped: refused",
                 "dropped: write_error", "waited for room"):
        assert name in text, (name, text)
    assert "ssd_full" not in text, "a reason nothing was dropped for is not listed"
    assert max(len(line) for line in text.splitlines()) <= width


def test_stats_keep_one_row_per_tier_where_that_fits() -> None:
    out = io.StringIO()
    kvctl_mod.render_stats(_stats(4, 0), Console(file=out, width=120))
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    assert rows[0].split("│")[1].strip() == "dram" and rows[1].split("│")[1].strip() == "ssd", rows


def test_peers_never_cuts_a_node_id_or_an_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvctl peers` into a pipe or a log printed "decode-node-…" and "10.120.230.1…": the one
    thing an operator looks for in that table was gone."""
    node, address = "decode-node-042.cluster-a.example.com", "10.120.230.142:7071"
    view = {"node_id": "prefill-node-017.cluster-a.example.com", "listen": "10.120.230.117:7071",
            "membership": "etcd",
            "peers": [{"node_id": node, "address": address, "state": "down", "blocks_fetched": 123456789,
                       "blocks_pushed": 987654321,
                       "last_error": f"cannot connect to {node} at {address}: [Errno 111] Connection refused"}]}

    class FakeClient:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> FakeClient:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def peers(self) -> dict[str, Any]:
            return view

    monkeypatch.setattr(kvctl_mod, "Client", FakeClient)
    monkeypatch.delenv("COLUMNS", raising=False)
    out = CliRunner().invoke(kvctl_mod.cli, ["--socket", "/nonexistent.sock", "peers"])
    assert out.exit_code == 0, out.output
    assert "…" not in out.output, out.output
    for value in (node, address, "123456789", "987654321", view["peers"][0]["last_error"]):   # each on one line
        assert value in out.output, (value, out.output)
