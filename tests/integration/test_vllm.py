"""Real vLLM (the CPU build, in its own environment .venv-vllm) with kvstored's connector and a real
daemon: a fresh engine takes a prompt another engine stored and answers the same; the loaded bytes
are what it used; every chunk of a long prefill is stored; a partial hit prefills only the rest; a
daemon that is down, restarted (the prefix then comes from SSD) or killed under a load never takes
the engine down; engines on peer daemons take a prompt pushed to them or fetch it; a decode engine starts on the
part of a prompt that has arrived from its peer when the rest would come later than it computes it.

Each vLLM process costs ~15-30 s, so one scenario runs once for the module (four engines in
sequence, each serving several prompts) and each test checks one thing it showed. The vLLM
environment comes from tools/ci/install-vllm.sh (the test command runs it); without it these tests
fail, saying so, unless KVSTORED_VLLM=skip says vLLM was left out on purpose.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from loopback import free_ports

import kvstored
from conftest import ROOT, Daemon, start_daemon

VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
STAMP = ROOT / ".venv-vllm" / ".kvstored-vllm-installed"
DRIVER = ROOT / "tests" / "integration" / "vllm_driver.py"
MARK = "KVSTORED-TEST "
BLOCK = 64                  # vllm_driver.BLOCK_SIZE
TIMEOUT_S = 400

if os.environ.get("KVSTORED_VLLM") == "skip":
    pytest.skip("KVSTORED_VLLM=skip: vLLM deliberately not installed", allow_module_level=True)

_rng = random.Random(28)
P1 = [_rng.randrange(3, 1024) for _ in range(1000)]         # ~1,000 tokens: 15 whole blocks
PL = [_rng.randrange(3, 1024) for _ in range(1500)]         # longer than the 512-token prefill chunk
PS = P1[:640] + [_rng.randrange(3, 1024) for _ in range(300)]   # P1's first 10 blocks, then new
PA = [_rng.randrange(3, 1024) for _ in range(16 * BLOCK)]    # whole blocks only: its last token ends a block


def whole_blocks(prompt: list[int], computed_extra: int = 7) -> int:
    """Whole blocks an engine has computed once it answered 8 tokens (the last one is never computed)."""
    return (len(prompt) + computed_extra) // BLOCK


@dataclass
class Engine:
    """A vLLM process running ``vllm_driver.py serve``; ``lines()`` yields what it reports."""

    proc: subprocess.Popen[str]
    log: Path
    answers: list[dict[str, Any]] = field(default_factory=list)
    path: str = ""              # the connector's: "zero-copy" or "copying"

    def lines(self) -> Iterator[dict[str, Any]]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                item = json.loads(line[len(MARK):])
                if "tokens" in item:
                    self.answers.append(item)
                self.path = item.get("path", self.path)
                yield item

    def finish(self) -> list[dict[str, Any]]:
        for _ in self.lines():
            pass
        code = self.proc.wait(TIMEOUT_S)
        assert code == 0, f"vLLM exited with {code}:\n{self.log.read_text()[-6000:]}"
        return self.answers


def start_engine(tmp: Path, name: str, steps: list[dict[str, Any]], socket: str,
                 connector: str = "KVStoredConnector", env: dict[str, str] | None = None,
                 hash_algo: str = "sha256_cbor", role: str = "kv_both", **settings: Any) -> Engine:
    """``settings``: kv_connector_extra_config beyond the socket."""
    steps_path = tmp / f"{name}.json"
    steps_path.write_text(json.dumps(steps))
    module = "kvstored_client.vllm.connector" if connector == "KVStoredConnector" else "vllm_test_connectors"
    log = tmp / f"{name}.log"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "integration"), **(env or {})}
    proc = subprocess.Popen([str(VENV_PYTHON), str(DRIVER), "serve", str(tmp / "model"), str(steps_path),
                             "--extra", json.dumps({"socket": socket, **settings}), "--module", module,
                             "--connector", connector, "--hash-algo", hash_algo, "--role", role],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=ROOT, env=full_env)
    return Engine(proc, log)


def prompt(tokens: list[int]) -> dict[str, Any]:
    return {"prompt": tokens, "max_tokens": 8}


def saved_blocks(socket: str) -> int:
    with kvstored.Client(socket) as client:
        return int(client.stats()["saved_blocks"])


@dataclass
class Scenario:
    a: list[dict[str, Any]]                 # engine A, copying path: P1, PL (stores them), P1 (restored)
    b: list[dict[str, Any]]                 # engine B, fresh, zero copy: P1, PL, PS
    zeroed: list[dict[str, Any]]            # engine C, zero copy, all layers at once: P1, its loaded KV zeroed
    d: list[dict[str, Any]]                 # engine D, zero copy: P1, PS (daemon down), P1 (restarted), PL (killed)
    paths: dict[str, str]                   # each engine's path, as its connector says
    saved_after_a: int
    saved_by_b: int
    killed: bool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny model (``model/``), for the engines' files too."""
    if not (VENV_PYTHON.exists() and STAMP.exists()):
        pytest.fail("vLLM's environment is missing: tools/ci/install-vllm.sh did not finish (the test command runs "
                    "it; its output says why). Set KVSTORED_VLLM=skip to leave vLLM out deliberately.")
    tmp = tmp_path_factory.mktemp("vllm")
    made = subprocess.run([str(VENV_PYTHON), str(DRIVER), "make-model", str(tmp / "model")], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert made.returncode == 0, made.stderr[-4000:]
    return tmp


@pytest.fixture(scope="module")
def scenario(model_dir: Path) -> Iterator[Scenario]:
    tmp = model_dir
    args = ("--set", "ssd.admission=always")
    daemons: list[Daemon] = [start_daemon(tmp / "d", *args)]
    socket = daemons[0].socket
    engines: dict[str, Engine] = {}
    try:
        # after the reset A's own cache is empty: its second P1 comes from kvstored, by copying
        engines["a"] = start_engine(tmp, "a", [prompt(P1), prompt(PL), {"reset": True}, prompt(P1), prompt(PA)],
                                    socket,
                                    zero_copy=False)
        a = engines["a"].finish()
        saved_after_a = saved_blocks(socket)
        # the reset: PS's shared prefix then comes from kvstored, not from B's own cache of P1
        engines["b"] = start_engine(tmp, "b", [prompt(P1), prompt(PL), {"reset": True}, prompt(PS), prompt(PA)],
                                    socket)
        b = engines["b"].finish()
        saved_by_b = saved_blocks(socket) - saved_after_a
        engines["c"] = start_engine(tmp, "c", [prompt(P1)], socket, connector="ZeroingConnector", layerwise=False)
        zeroed = engines["c"].finish()

        daemons[0].stop()   # SIGTERM: what is only in DRAM goes to SSD first
        restarted, armed = tmp / "restarted", tmp / "armed"
        d = engines["d"] = start_engine(
            tmp, "d", [prompt(P1), prompt(PS), {"wait_for": str(restarted)}, {"reset": True}, prompt(P1),
                       {"reset": True}, {"wait_for": str(armed)}, prompt(PL)],
            socket, connector="KillingConnector", env={"KVSTORED_TEST_KILL": str(armed)})
        killed = False
        for item in d.lines():
            if len(d.answers) == 2 and not restarted.exists():
                daemons.append(start_daemon(tmp / "d", *args))   # the same SSD: DRAM starts empty
                restarted.touch()
            elif len(d.answers) == 3 and not armed.exists():
                armed.write_text(str(daemons[-1].proc.pid))
            killed = killed or bool(item.get("killed"))
        yield Scenario(a, b, zeroed, d.finish(), {k: e.path for k, e in engines.items()}, saved_after_a,
                       saved_by_b, killed)
    finally:
        for engine in engines.values():
            if engine.proc.poll() is None:
                engine.proc.kill()
                engine.proc.wait()
        for daemon in daemons:
            daemon.stop(signal.SIGKILL)


def test_the_vllm_environment_has_none_of_the_daemons_own_dependencies() -> None:
    """The SDK's own dependencies only: the daemon's that vLLM does not bring itself (vLLM
    needs uvloop and prometheus-client) are absent, and the connector works without them."""
    if not VENV_PYTHON.exists():
        pytest.fail("vLLM's environment is missing: tools/ci/install-vllm.sh did not finish")
    code = ("import importlib.util as u, sys, kvstored_client; "
            "print(sorted(m for m in ('lmdb', 'aetcd', 'grpc_health') if u.find_spec(m))); "
            "print('vllm' in sys.modules)")
    out = subprocess.run([str(VENV_PYTHON), "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "False"]   # and importing the SDK imports no vLLM


def test_vllms_kv_cache_is_shared_with_the_daemon_unless_told_otherwise(scenario: Scenario) -> None:
    assert scenario.paths == {"a": "copying", "b": "zero-copy", "c": "zero-copy", "d": "zero-copy"}


def test_a_fresh_engine_takes_the_prompt_from_kvstored_and_answers_the_same(scenario: Scenario) -> None:
    first, restored = scenario.a[0], scenario.b[0]   # stored by the copying path, loaded by zero copy
    assert first["cached"] == 0
    assert restored["cached"] >= 0.9 * len(P1)
    assert restored["tokens"] == first["tokens"]


def test_the_copying_path_restores_the_prompt_too(scenario: Scenario) -> None:
    assert scenario.a[2]["cached"] >= 0.9 * len(P1)
    assert scenario.a[2]["tokens"] == scenario.a[0]["tokens"]


def test_a_prompt_of_whole_blocks_is_restored_up_to_its_last_token(scenario: Scenario) -> None:
    """Its last block is loaded too: vLLM computes only the last token, not the last block's 64."""
    assert scenario.a[3]["cached"] == 0
    assert scenario.b[3]["cached"] == len(PA) - 1
    assert scenario.b[3]["tokens"] == scenario.a[3]["tokens"]


def test_zeroed_loaded_kv_changes_the_answer(scenario: Scenario) -> None:
    """The control: the same load with its bytes zeroed (each layer once it is in place) gives
    other tokens, so B used the bytes."""
    assert scenario.zeroed[0]["cached"] >= 0.9 * len(P1)
    assert scenario.zeroed[0]["tokens"] != scenario.a[0]["tokens"]


def test_every_chunk_of_a_long_prefill_is_stored_and_restored(scenario: Scenario) -> None:
    # not only the first 512-token chunk
    assert scenario.saved_after_a == whole_blocks(P1) + whole_blocks(PL) + whole_blocks(PA)
    assert scenario.b[1]["cached"] == (len(PL) - 1) // BLOCK * BLOCK
    assert scenario.b[1]["tokens"] == scenario.a[1]["tokens"]


def test_a_partial_hit_prefills_only_the_new_suffix_and_stores_its_blocks(scenario: Scenario) -> None:
    shared = 640
    assert scenario.b[2]["cached"] == shared
    assert scenario.saved_by_b == whole_blocks(PS) - shared // BLOCK
    assert scenario.b[2]["tokens"] == scenario.d[1]["tokens"]   # D computed PS with no daemon at all


def test_an_engine_started_while_the_daemon_is_down_serves(scenario: Scenario) -> None:
    assert scenario.d[0]["cached"] == 0
    assert scenario.d[0]["tokens"] == scenario.a[0]["tokens"]


def test_after_a_daemon_restart_the_prefix_comes_from_ssd(scenario: Scenario) -> None:
    assert scenario.d[2]["cached"] >= 0.9 * len(P1)
    assert scenario.d[2]["tokens"] == scenario.a[0]["tokens"]


def test_a_daemon_killed_before_the_load_leaves_the_engine_answering_right(scenario: Scenario) -> None:
    assert scenario.killed   # the lookup had found PL's blocks, the daemon died before their load
    assert scenario.d[3]["tokens"] == scenario.a[1]["tokens"]


def test_vllms_pickle_based_block_hashes_are_refused_at_start_up(model_dir: Path) -> None:
    """Its default ``sha256`` hashes differ between processes: no other engine could find the blocks."""
    engine = start_engine(model_dir, "pickle", [prompt(P1)], str(model_dir / "no-daemon.sock"), hash_algo="sha256")
    assert list(engine.lines()) == []
    assert engine.proc.wait(TIMEOUT_S) != 0
    assert "KVStoredConnector needs prefix_caching_hash_algo='sha256_cbor'" in engine.log.read_text()


def test_prefill_and_decode_on_peer_daemons_by_push_and_by_pull(
        scenario: Scenario, model_dir: Path, daemon_factory: Any) -> None:
    """Prefill/decode on daemons that are peers: the prefill engine's connector has its daemon
    push each stored chunk to the decode node (``push_to``), and the decode engine finds the
    prompt in its own daemon; an engine on a third node (``peers``) finds it on its peers and
    fetches it. Both answer as a single node does."""
    names = ("prefill", "decode", "third")
    ports = free_ports(len(names))
    static = ",".join(f"{n}=127.0.0.1:{p}" for n, p in zip(names, ports))
    nodes = {name: daemon_factory("--set", f"peers.listen=127.0.0.1:{port}", "--set", f"peers.node_id={name}",
                                  "--set", f"peers.static={static}", "--set", "peers.token=t0ken")
             for name, port in zip(names, ports)}
    start_engine(model_dir, "prefill", [prompt(P1)], nodes["prefill"].socket, push_to="decode").finish()
    with kvstored.Client(nodes["decode"].socket) as client:
        deadline = time.monotonic() + 60   # the pushes run in the background: wait for them to land
        while client.stats()["peer_received_blocks"] < whole_blocks(P1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats()["peer_received_blocks"] == whole_blocks(P1)
    decoded = start_engine(model_dir, "decode", [prompt(P1)], nodes["decode"].socket).finish()
    assert decoded[0]["cached"] >= 0.9 * len(P1)
    assert decoded[0]["tokens"] == scenario.a[0]["tokens"]

    pulled = start_engine(model_dir, "third", [prompt(P1)], nodes["third"].socket, peers=True).finish()
    assert pulled[0]["cached"] >= 0.9 * len(P1)
    assert pulled[0]["tokens"] == scenario.a[0]["tokens"]
    with kvstored.Client(nodes["third"].socket) as client:
        assert client.stats()["peer_fetched_blocks"] == (len(P1) - 1) // BLOCK   # what vLLM asked for


def test_a_decode_engine_starts_on_the_prefix_that_has_arrived(model_dir: Path, daemon_factory: Any) -> None:
    """Prefill/decode by roles: a producer engine stores two prompts on its daemon, a consumer
    engine on a peer daemon (``peers``) pulls each into its own daemon and waits by the wait rule.
    Over a link slower than the engine computes (a proxy pacing the producer's side to a block
    every half second), it starts on the blocks that arrived and computes the rest: its first
    token comes while its daemon holds part of the prompt, which still arrives whole later. Over
    a fast link it waits for and takes the whole prefix. Both answer as a single node does."""
    from netfault import FaultProxy

    rng = random.Random(5)
    p2 = [rng.randrange(3, 1024) for _ in range(1000)]
    port_a, port_b = free_ports(2)
    block_bytes = 4 * 2 * BLOCK * 2 * 64 * 4      # vllm_driver's model: layers * K,V * tokens * heads * dims * fp32
    proxy = FaultProxy(("127.0.0.1", port_a), rate_bytes_s=block_bytes / 0.5)
    try:
        common = ("--set", "peers.token=t0ken")
        a = daemon_factory("--set", f"peers.listen=127.0.0.1:{port_a}", "--set", "peers.node_id=prefill",
                           "--set", f"peers.static=decode=127.0.0.1:{port_b}", *common)
        # the peer lookup's own deadline (1 s) lengthened: on a loaded machine the proxy's answer
        # may come later, and the consumer would then see nothing to fetch
        b = daemon_factory("--set", f"peers.listen=127.0.0.1:{port_b}", "--set", "peers.node_id=decode",
                           "--set", f"peers.static=prefill=127.0.0.1:{proxy.port}",
                           "--set", "peers.lookup_timeout_s=10", *common)
        single = start_engine(model_dir, "producer", [prompt(P1), prompt(p2)], a.socket, role="kv_producer").finish()
        assert [x["cached"] for x in single] == [0, 0]    # a producer never loads: a single node's answers
        # The engine's prefill rate is set far below this machine's so that the decision does
        # not hang on its load: 256 tokens/s is 4 blocks/s, twice what the slow link can bring
        # (its first block's latency only lowers that) and far less than loopback does.
        checked, done = model_dir / "consumer-checked", model_dir / "consumer-done"
        consumer = start_engine(model_dir, "consumer", [prompt(P1), {"wait_for": str(checked)}, prompt(p2),
                                                        {"wait_for": str(done)}],
                                b.socket, role="kv_consumer", peers=True, prefill_tokens_per_s=256, max_wait_s=60)
        with kvstored.Client(b.socket) as client:
            fetched_at_answer: list[int] = []
            for _ in consumer.lines():
                if len(consumer.answers) == 1 and not checked.exists():
                    fetched_at_answer.append(int(client.stats()["peer_fetched_blocks"]))
                    deadline = time.monotonic() + 60   # the pull goes on: the whole prompt lands
                    while client.stats()["peer_fetched_blocks"] < whole_blocks(P1) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    fetched_at_answer.append(int(client.stats()["peer_fetched_blocks"]))
                    proxy.rate = 0.0   # the control: a fast link
                    checked.touch()
                elif len(consumer.answers) == 2:
                    done.touch()
            decoded = consumer.finish()
        started_on, arrived = fetched_at_answer
        assert decoded[0]["tokens"] == single[0]["tokens"]
        assert 0 < decoded[0]["cached"] < (len(P1) - 1) // BLOCK * BLOCK   # part of the prompt from kvstored
        assert decoded[0]["cached"] // BLOCK <= started_on < whole_blocks(P1) == arrived
        assert decoded[1]["tokens"] == single[1]["tokens"]
        assert decoded[1]["cached"] == (len(p2) - 1) // BLOCK * BLOCK        # the whole prefix, waited for
    finally:
        proxy.close()
