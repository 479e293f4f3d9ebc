"""Repository checks: generated code in sync, lint and types, systemd unit, SDK stays light."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_generated_proto_code_matches_protos() -> None:
    out = run(sys.executable, "tools/gen_proto.py", "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff() -> None:
    out = run(str(BIN / "ruff"), "check", "kvstored", "client", "tools", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy() -> None:
    out = run(str(BIN / "mypy"), "--no-incremental", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sdk_import_loads_no_daemon_dependencies() -> None:
    code = ("import sys, kvstored, kvstored_client; "
            "bad = [m for m in ('uvloop', 'lmdb', 'kvstored.server', 'kvstored.store', 'torch') "
            "if m in sys.modules]; print(bad)")
    out = run(sys.executable, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_daemon_imports_of_the_sdk_only_the_contract_and_its_top_level_names() -> None:
    """What the daemon and the SDK share is named: ``kvstored_client.contract``. The daemon
    reaching into another SDK module (as it did into the private ``_proto``) is a dependency
    nobody sees when changing the SDK."""
    import ast

    stray = []
    for path in sorted((ROOT / "kvstored").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            stray += [f"{path.relative_to(ROOT)}: {name}" for name in names
                      if name.startswith("kvstored_client.") and not name.startswith("kvstored_client.contract")]
    assert stray == []


def test_the_proto_lists_the_reasons_a_daemon_sends_under_their_status_codes() -> None:
    """Raw gRPC clients learn the reason codes from the proto's header: the same as the
    contract's, each under the status code its class travels as."""
    from kvstored_client.contract.errors import Reason
    from kvstored_client.errors import _BY_REASON

    header = (ROOT / "proto" / "kvstored" / "v1" / "kvstored.proto").read_text().split("syntax =")[0]
    listed: dict[str, set[str]] = {}
    for code, names in re.findall(r"^//   ([A-Z_]+): ([A-Z_, ]+(?:\n//     [A-Z_, ]+)*)", header, re.M):
        listed[code] = set(re.findall(r"[A-Z_]+", names))
    expected: dict[str, set[str]] = {}
    for reason, cls in _BY_REASON.items():
        if reason is not Reason.UNAVAILABLE:   # the SDK's, for a daemon it could not reach
            assert cls.code is not None
            expected.setdefault(cls.code.name, set()).add(reason.value)
    assert listed == expected


@pytest.mark.parametrize("args", [("--help",), ("-h",), ("--quick",)])
def test_gpu_check_with_arguments_runs_nothing(tmp_path: Path, args: tuple[str, ...]) -> None:
    """``tools/gpu-check --help`` ran the whole check, pip-installing what the interpreter lacked
    (cupy, grpcio, ...) into it: help prints its description, any other argument is refused, and
    neither reaches the interpreter."""
    marker = tmp_path / "python-ran"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out")}
    out = subprocess.run([str(ROOT / "tools" / "gpu-check"), *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, env=env)
    if args[0] in ("--help", "-h"):
        assert out.returncode == 0 and "CUDA IPC tests" in out.stdout and "Usage:" in out.stdout, out
    else:
        assert out.returncode == 2 and "takes no arguments" in out.stderr, out
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (ROOT / "systemd" / "kvstored.service").read_text()
    assert "Type=notify" in unit and "LimitMEMLOCK=infinity" in unit and "PrivateDevices=yes" not in unit
    # verify checks that ExecStart exists: point it at this environment's entry point
    (tmp_path / "kvstored.service").write_text(unit.replace("/usr/bin/kvstored", str(BIN / "kvstored")))
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "warning"}
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kvstored.service")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kvstored.service" not in out.stderr, out.stderr  # no warnings about our unit


def _unit_values(key: str) -> list[str]:
    """The space-separated values of every ``key=`` line of systemd/kvstored.service."""
    unit = (ROOT / "systemd" / "kvstored.service").read_text()
    return [v for line in unit.splitlines() if line.startswith(f"{key}=") for v in line.split("=", 1)[1].split()]


def test_systemd_unit_starts_once_the_network_is_up() -> None:
    """The daemon binds peers.listen / server.tcp on the node's address and joins etcd at start:
    ordered only after network.target, a boot started it before that address existed ("cannot
    assign requested address", etcd unreachable), and five quick failures (RestartSec=2) hit
    systemd's start limit, leaving the node without its cache until someone restarted it."""
    assert "network-online.target" in _unit_values("Wants")
    assert "network-online.target" in _unit_values("After")


def test_systemd_unit_does_not_restart_a_config_error(tmp_path: Path) -> None:
    """(review) A config error exits 2 naming the key; Restart=on-failure started the daemon again
    every 2 s into the same error until systemd's start limit. The unit stops there, and 2 is what
    the daemon does exit with on a bad value."""
    assert _unit_values("RestartPreventExitStatus") == ["2"]
    proc = subprocess.run([str(BIN / "kvstored"), "--no-config", "--set", "dram.capacity=-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "dram.capacity" in proc.stderr, proc.stderr


def test_systemd_unit_leaves_the_gpu_device_nodes_reachable() -> None:
    """The unit means to keep /dev/nvidia* open to the daemon (cudaHostRegister, CUDA IPC copies
    into engine buffers), so it sets no PrivateDevices=, DevicePolicy= or DeviceAllow=. But
    ProtectClock=yes implies DeviceAllow=char-rtc r, and on a systemd older than the fix of
    systemd/systemd#18142 (#25075, around v252; Ubuntu 22.04 has 249, Debian 11 247) that one
    allow-list entry closed every other device to the service: the GPU path failed there."""
    for key in ("ProtectClock", "PrivateDevices", "DevicePolicy", "DeviceAllow"):
        assert _unit_values(key) in ([], ["no"], ["false"]), key


def test_a_directory_the_unit_keeps_read_only_is_documented_where_it_is_configured() -> None:
    """The unit's ProtectSystem=strict leaves only StateDirectory= and ReadWritePaths= writable:
    ``ssd.path`` on its own NVMe mount (the usual set-up; the example config offers the key)
    failed at start with "Read-only file system", and neither the example config nor the README
    said that the directory must be added to ReadWritePaths=."""
    assert "strict" in _unit_values("ProtectSystem")
    example = (ROOT / "systemd" / "kvstored.toml").read_text()
    ssd = re.search(r"^\[ssd\]\n(.*?)(?=^\[)", example, re.S | re.M)
    assert ssd is not None and "ReadWritePaths=" in ssd.group(1), "[ssd] path: say it needs ReadWritePaths="
    service = re.search(r"^As a service:(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert service is not None and "ReadWritePaths=" in service.group(1)


# -- README against the code ------------------------------------------------------------------
README = (ROOT / "README.md").read_text()


def _readme_section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m is not None, f"README has no section {title!r}"
    return m.group(1)


def _expand(name: str) -> list[str]:
    """``kvstored_tier_{capacity,used}_bytes`` -> the names it stands for."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", name)
    if m is None:
        return [name]
    return [n for alt in m.group(1).split(",") for n in _expand(name[:m.start()] + alt + name[m.end():])]


def test_readme_metric_names_exist() -> None:
    """Every ``kvstored_*`` metric the README names is one the daemon exposes."""
    from prometheus_client.core import CounterMetricFamily

    from kvstored.server import metrics

    exposed = {"kvstored_rpc_duration_seconds"}
    for kind, name, _doc, _attr in metrics._TIER_METRICS + metrics._STORE_METRICS + metrics._PEER_METRICS:
        exposed.add(f"kvstored_{name}" + ("_total" if kind is CounterMetricFamily else ""))
    named = set()
    for span in re.findall(r"`(kvstored_[^`]*)`", README):
        named.update(_expand(re.sub(r"\{\w+\}$", "", span)))   # a trailing {label} is not part of the name
    assert len(named) > 10, named
    assert named - exposed == set()


def test_readme_names_every_kvctl_command_and_option() -> None:
    import click

    from kvstored.kvctl import cli

    missing = [o for p in cli.params if isinstance(p, click.Option) for o in p.opts if o not in README]
    for name, command in cli.commands.items():
        if not re.search(rf"`(kvctl )?{name}\b", README):
            missing.append(name)
        missing += [f"{name} {o}" for p in command.params if isinstance(p, click.Option)
                    for o in p.opts if o.startswith("--") and o != "--help" and o not in README]
    assert missing == []


def test_readme_names_every_sdk_error() -> None:
    """README: "every failure is a `kvstored.KVStoreError` subclass (...)": all of them, by name."""
    import kvstored

    errors = [name for name in kvstored.__all__
              if isinstance(obj := getattr(kvstored, name), type) and issubclass(obj, kvstored.KVStoreError)]
    assert len(errors) > 5
    assert [name for name in errors if not re.search(rf"`(kvstored\.)?{name}`", README)] == []


def test_readme_daemon_flags_match_the_daemon(capsys: pytest.CaptureFixture[str]) -> None:
    """The flags "Running the daemon" names are the daemon's, and it names all of them."""
    from kvstored.server import app

    with pytest.raises(SystemExit):
        app.parse_args(["--help"])
    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", capsys.readouterr().out)) - {"--help"}
    named = set(re.findall(r"`(--[a-z][\w-]*)", _readme_section("Running the daemon")))
    assert (flags - named, named - flags) == (set(), set())


def test_readme_sdk_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's first two SDK snippets run as written against a daemon on its embedded
    defaults (a smaller arena) and do what their comments say; the two-node one at least compiles."""
    pytest.importorskip("torch")
    from conftest import start_daemon

    blocks = re.findall(r"```python\n(.*?)```", _readme_section("Using the SDK"), re.S)
    assert len(blocks) == 3
    compile(blocks[2], "README prefill/decode snippet", "exec")
    daemon = start_daemon(tmp_path, "--dram-capacity", "256MiB", "--set", "dram.page_bytes=32MiB")
    monkeypatch.setenv("KVSTORED_SOCKET", daemon.socket)   # where the snippets' Client() looks first
    ns: dict[str, Any] = {}
    clients = []
    try:
        exec(compile(blocks[0], "README SDK snippet", "exec"), ns)
        clients.append(client := ns["client"])
        assert client.stats()["saved_blocks"] == 62
        assert client.lookup(ns["tokens"]).tokens == 992
        assert ns["res"].blocks == 62 and ns["res"].tokens == 992
        exec(compile(blocks[1], "README engine snippet", "exec"), ns)
        clients.append(engine := ns["client"])
        assert engine.stats()["saved_blocks"] == 62 + 3
        assert engine.load_blocks(ns["buffers"], block_ids=[5, 6, 7], tokens=ns["prompt"][:48]).blocks == 3
    finally:
        for c in clients:
            c.close()
        for tensor in ns.get("layers", []):
            tensor.close()
        assert daemon.stop() == 0, daemon.log()[-2000:]


def test_readme_prefill_decode_snippet_runs(tmp_path: Path) -> None:
    """The README's prefill/decode snippet against two daemons that are each other's peers: the
    prefill half on one (its own ``buffers``), the decode half on the other; then, with the decode
    node emptied, its ``pull`` alone brings the prompt back. As written before, ``decode.pull(prompt)``
    looked in the client's namespace, not the buffers' where ``save_blocks`` had put the blocks, and
    pulled nothing (stop "no_room": the namespace's block size unknown there)."""
    pytest.importorskip("torch")
    import numpy as np
    from loopback import free_ports

    import kvstored
    from conftest import start_daemon

    snippet = re.findall(r"```python\n(.*?)```", _readme_section("Using the SDK"), re.S)[2]
    prefill_part, decode_part, pull_part = re.split(r"^(?=# decode node|# or, ahead of the request)", snippet,
                                                    flags=re.M)
    ports = free_ports(2)
    static = f"prefill=127.0.0.1:{ports[0]},decode-0=127.0.0.1:{ports[1]}"
    daemons = [start_daemon(tmp_path / name, "--set", f"peers.listen=127.0.0.1:{port}", "--set",
                            f"peers.node_id={name}", "--set", f"peers.static={static}", "--set", "peers.token=t")
               for name, port in zip(["prefill", "decode-0"], ports)]
    ns_model = kvstored.Namespace(model="readme-pd", kv_dtype="bfloat16")
    tensors: list[Any] = []
    clients: list[Any] = []
    try:
        def engine(socket: str) -> tuple[Any, Any]:
            client = kvstored.Client(socket, namespace=ns_model)
            clients.append(client)
            layers = [kvstored.shm.empty((2, 32, 16, 2, 64), "bfloat16") for _ in range(2)]
            tensors.extend(layers)
            return client, client.register_buffers([t.torch() for t in layers], block_dim=1)

        prefill, prefill_buffers = engine(daemons[0].socket)
        decode, decode_buffers = engine(daemons[1].socket)
        prompt = np.arange(16 * 12 + 5)   # 12 whole blocks
        recomputed: list[int] = []
        env: dict[str, Any] = {"prefill": prefill, "decode": decode, "prompt": prompt, "chunk_ids": list(range(12)),
                               "end": len(prompt), "ids": list(range(20, 32)), "recompute_from": recomputed.append}
        exec(compile(prefill_part, "README prefill half", "exec"), {**env, "buffers": prefill_buffers})
        decode_env = {**env, "buffers": decode_buffers}
        exec(compile(decode_part, "README decode half", "exec"), decode_env)
        assert decode_env["stream"].outcome.complete and recomputed == []
        assert decode.evict() == 12
        exec(compile(pull_part, "README pull", "exec"), decode_env)
        outcome = decode_env["outcome"]
        assert (outcome.stop, outcome.blocks, outcome.tokens) == ("complete", 12, 12 * 16), outcome
        assert decode.lookup(prompt, namespace=decode_buffers.namespace).per_tier == {"dram": 12}
    finally:
        for c in clients:
            c.close()
        for t in tensors:
            t.close()
        for d in daemons:
            assert d.stop() == 0, d.log()[-2000:]


def test_readme_block_hashes_signature_is_the_sdks() -> None:
    """README's ``kvstored.block_hashes(...)`` names every parameter with its default (it left
    out the keyword-only cache_salt and lora_name that vLLM compatibility needs)."""
    import inspect

    import kvstored

    m = re.search(r"`kvstored\.block_hashes\(([^`]*)\)`", README)
    assert m is not None
    documented = " ".join(m.group(1).split())
    params = []
    star = False
    for p in inspect.signature(kvstored.block_hashes).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}".replace("'", '"'))
    assert documented == ", ".join(params)
