"""SGLang's HiCache storage layer on kvstored: SGLang's own factory and base class (in an
environment of their own, .venv-sglang) move a host pool's pages through a real daemon."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, Daemon, start_daemon

HOST = ROOT / "tests" / "sglang_host.py"


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """The SGLang environment's python, installed by the project's script on first use (minutes;
    instant after). A failed install fails the tests with its output: they are never skipped."""
    out = subprocess.run(["bash", "tools/ci/install-sglang.sh"], cwd=ROOT, capture_output=True, text=True,
                         timeout=1200)
    if out.returncode != 0:
        pytest.fail(f"tools/ci/install-sglang.sh failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return str(ROOT / ".venv-sglang" / "bin" / "python")


def run(python: str, scenario: str, socket: str) -> dict[str, Any]:
    out = subprocess.run([python, str(HOST), scenario, socket], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["result"]  # type: ignore[no-any-return]


pytestmark = pytest.mark.timeout(1500)   # the first test installs SGLang's environment


def test_an_engine_needs_none_of_the_daemons_dependencies(sglang_python: str, daemon: Daemon) -> None:
    found = run(sglang_python, "environment", daemon.socket)
    assert found == {"uvloop": False, "lmdb": False, "kvstored_client": True}


def test_pages_stored_by_one_sglang_are_served_to_another_byte_for_byte(sglang_python: str,
                                                                        daemon_factory: Any) -> None:
    daemon = daemon_factory()
    stored = run(sglang_python, "store", daemon.socket)
    assert stored["first"] == [True] * 8 and stored["second"] == [True] * 4
    # pages whose prefix the store never held are refused, not stored behind bytes nobody gave
    assert stored["orphans"] == [False, False]

    fetched = run(sglang_python, "fetch", daemon.socket)
    assert fetched["exists_all"] == 12
    assert fetched["exists_tail"] == 4
    assert fetched["exists_diverging"] == 5          # the shared leading pages only
    assert fetched["exists_orphans"] == 0
    assert fetched["exists_unknown"] == 0
    assert fetched["got"] == [True] * 8
    # pages 4..11 loaded over other bytes; pages 0..3 (the call's prefix, held by the engine) untouched
    assert fetched["digests"][4:] == stored["digests"][4:]
    assert all(a != b for a, b in zip(fetched["digests"][:4], stored["digests"][:4], strict=True))


def test_pages_survive_a_daemon_restart_from_ssd(sglang_python: str, tmp_path: Path) -> None:
    first = start_daemon(tmp_path / "d")
    stored = run(sglang_python, "store", first.socket)
    assert first.stop() == 0                          # SIGTERM writes DRAM's blocks to SSD
    second = start_daemon(tmp_path / "d")
    try:
        fetched = run(sglang_python, "fetch", second.socket)
    finally:
        second.stop()
    assert fetched["exists_all"] == 12 and fetched["got"] == [True] * 8
    assert fetched["digests"][4:] == stored["digests"][4:]


def test_single_page_calls_without_prefix_keys(sglang_python: str, daemon: Daemon) -> None:
    found = run(sglang_python, "flat", daemon.socket)
    assert found["set_one"] is True and found["set_batch"] is True
    assert found["exists"] == [True, True, True, False]
    assert found["batch_exists"] == 3
    assert found["equal"] == [True, True, True, False] and found["missing"] == [False, False, False, True]
    assert found["v1_got"] == [True, True, True, False] and found["v1_equal"] == [True, True, True]


def test_a_daemon_that_is_down_costs_misses_and_is_used_once_it_answers(sglang_python: str,
                                                                       tmp_path: Path) -> None:
    socket = str(tmp_path / "d" / "kv.sock")
    (tmp_path / "d").mkdir()
    proc = subprocess.Popen([sglang_python, str(HOST), "down", socket], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    daemon: Daemon | None = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        before = json.loads(proc.stdout.readline())["before"]
        assert before == {"exists": 0, "set": [False] * 4, "get": [False] * 4, "single": False}
        daemon = start_daemon(tmp_path / "d")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
        after = json.loads(out.strip().splitlines()[-1])["result"]
        assert after == {"after_set": [True] * 4, "after_exists": 4}
    finally:
        if proc.poll() is None:
            proc.kill()
        if daemon is not None:
            daemon.stop()


def test_an_mla_replica_rank_never_writes(sglang_python: str, daemon: Daemon) -> None:
    found = run(sglang_python, "replica", daemon.socket)
    assert found["rank1_set"] == [True, True]        # SGLang is told the pages are kept...
    assert found["seen_before"] == 0                 # ...by the writer rank, not this one
    assert found["rank0_set"] == [True, True] and found["seen_after"] == 2
