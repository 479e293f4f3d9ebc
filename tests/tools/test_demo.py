"""tools/demo.sh, the README's first command, run as a user would (only the install step is
stubbed): it runs against the daemon it started, fails loudly when the product misbehaves, and
leaves no daemon and no state behind, whether it passed or failed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstored
from conftest import start_daemon

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short directory in place of pytest's (``/tmp/pytest-of-USER/pytest-N/test_name0``): the
    demo's socket lies three levels under it, and with a user name of eight letters pytest's left
    too few of a socket path's 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def run_demo(tmp_path: Path, *daemon_args: str, sitecustomize: str = "",
             before_daemon: str = "") -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run a copy of tools/demo.sh whose .venv runs this checkout's code (``daemon_args`` added to
    the daemon's command line, ``sitecustomize`` run first in every Python process, the shell
    lines ``before_daemon`` before each start of the daemon) with the user's default socket under
    ``tmp_path/run``; returns the run and its TMPDIR (where the demo's state and log go)."""
    checkout = tmp_path / "checkout"
    (checkout / "tools").mkdir(parents=True)
    for name in ("demo.sh", "demo.py"):
        shutil.copy(ROOT / "tools" / name, checkout / "tools" / name)
    venv = checkout / ".venv" / "bin"
    venv.mkdir(parents=True)
    py = sys.executable
    _script(venv / "python", f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 0\nexec {py} "$@"\n')
    extra = " ".join(daemon_args)
    _script(venv / "kvstored", f'#!/bin/sh\n{before_daemon}\nexec {py} -m kvstored "$@" {extra}\n')
    _script(venv / "kvctl", f'#!/bin/sh\nexec {py} -m kvstored.kvctl "$@"\n')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTORED_SOCKET", "NOTIFY_SOCKET", "STATE_DIRECTORY")}
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize)
    env.update(PYTHONPATH=f"{site}:{ROOT / 'client'}:{ROOT}", TMPDIR=str(tmp), XDG_RUNTIME_DIR=str(tmp_path / "run"),
               XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.run(["bash", str(checkout / "tools" / "demo.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, tmp


def assert_nothing_left(proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    assert not list(tmp.glob("kvstored-demo-state.*")), "the demo's state directory was left behind"
    started = re.findall(r"kvstored started \(pid (\d+)", proc.stdout)
    assert started, proc.stdout
    for pid in started:   # the daemon, and the one started again on its state
        assert not Path(f"/proc/{pid}").exists(), f"the demo's daemon {pid} is still running"


def test_the_demo_runs_against_the_daemon_it_started_not_one_on_the_default_socket(tmp_path: Path) -> None:
    """(review) The demo's daemon took the default socket: where a daemon already listened there
    (the user's own, another demo's), it refused to start, and the demo ran every scenario
    against that other daemon (filling its cache, 'cold' requests warm) and showed its stats."""
    other = start_daemon(tmp_path / "run" / "kvstored", name="kvstored")   # on the default socket
    try:
        proc, tmp = run_demo(tmp_path)
        with kvstored.Client(other.socket) as c:
            st = c.stats()
    finally:
        other.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert st["saved_blocks"] == 0 and st["lookups"] == 0, f"the demo used the other daemon: {st}"
    assert "5b. decode node streams from peer" in proc.stdout and "saved blocks" in proc.stdout
    assert "6c. prefetch, then load" in proc.stdout
    assert "7b. request 6d (written at the stop)" in proc.stdout, proc.stdout[-3000:]
    assert_nothing_left(proc, tmp)
    assert not list(tmp.glob("kvstored-demo.*.log")), "a passing demo left its log behind"


# A daemon that keeps only the first 8 blocks of every prompt the demo's own client saves (and
# says so): what the scenarios reuse is then a fraction of what they claim to reuse.
KEEPS_8_BLOCKS = """
import kvstored_client.client as c
_save = c.Client.save
def save(self, tokens, kv, **kw):
    if self._client_name == "demo":
        return _save(self, tokens[: 8 * 16], kv[:8], **kw)
    return _save(self, tokens, kv, **kw)
c.Client.save = save
"""


def test_a_daemon_that_keeps_part_of_each_prompt_fails_the_demo(tmp_path: Path) -> None:
    """(review) The scenarios printed how much was reused but checked only that what came back was
    right: a daemon keeping 8 blocks of each prompt passed "same system prompt" and the whole
    conversation with most of every prompt prefilled again, exit 0."""
    proc, tmp = run_demo(tmp_path, sitecustomize=KEEPS_8_BLOCKS)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "AssertionError" in proc.stderr and "demo FAILED" in proc.stderr, proc.stderr[-3000:]
    assert_nothing_left(proc, tmp)


def test_a_daemon_that_cannot_start_fails_the_demo_with_its_reason(tmp_path: Path) -> None:
    """(review) A daemon that exited at start made the demo wait 30 s for it, then the cleanup
    trap stopped at its first failing command (`kill` of the gone daemon, under `set -e`): the
    state directory stayed behind and the daemon's reason was only in a log file."""
    proc, tmp = run_demo(tmp_path, "--dram-capacity", "1000TiB")
    assert proc.returncode != 0
    assert "does not fit" in proc.stderr, proc.stderr[-3000:]
    assert_nothing_left(proc, tmp)


def test_the_demo_starts_its_two_nodes_again_when_a_port_is_taken_before_a_daemon_binds_it(
        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The demo picks free loopback ports, then starts daemons on them; another process may take
    one in between (a CI run failed so: "address already in use"). It tries fresh ports."""
    import socket

    from tools import demo

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks: list[list[int]] = []
    real = demo.pick_ports

    def first_taken(n: int) -> list[int]:
        picks.append([taken.getsockname()[1]] * n if not picks else real(n))
        return picks[-1]

    monkeypatch.setattr(demo, "pick_ports", first_taken)
    try:
        with demo.two_nodes() as (prefill, decode):
            assert prefill.stats()["version"] and decode.stats()["version"]
        assert len(picks) == 2, picks
    finally:
        taken.close()


def test_a_daemon_that_loses_its_ssd_tier_at_a_restart_fails_the_demo(tmp_path: Path) -> None:
    """The demo's last step starts the daemon again on the same state and loads what was saved:
    a daemon whose SSD tier did not survive the restart (its directory gone, here) must fail it,
    not pass with the prompts prefilled again."""
    forgets = 'if [ -e "$STATE_DIRECTORY/started" ]; then rm -rf "$STATE_DIRECTORY/ssd"; fi; ' \
              'touch "$STATE_DIRECTORY/started"'
    proc, tmp = run_demo(tmp_path, before_daemon=forgets)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "saved before the restart" in proc.stderr and "demo FAILED" in proc.stderr, proc.stderr[-3000:]
    assert "6d. a request after the flush" in proc.stdout   # the first daemon ran every scenario
    assert_nothing_left(proc, tmp)
