"""KV events from a real daemon, read as a vLLM-format consumer reads them: raw ZMQ frames."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

import kvstored
from conftest import start_daemon
from kvstored.events.wire import (
    END_OF_REPLAY,
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    encode_seq,
    epoch_of,
)

BLOCK = 4096


def events_args(tmp: Path, *extra: str) -> list[str]:
    return ["--set", "events.enabled=true", "--set", f"events.endpoint=ipc://{tmp}/pub",
            "--set", f"events.replay_endpoint=ipc://{tmp}/replay", "--set", "events.heartbeat_s=0.2",
            "--set", "events.node_id=n1", *extra]


class Consumer:
    def __init__(self, tmp: Path) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"ipc://{tmp}/pub")
        self.replay_endpoint = f"ipc://{tmp}/replay"

    def frames(self, seconds: float) -> list[list[bytes]]:
        out = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sub.poll(int(left * 1000)):
                out.append(self.sub.recv_multipart())
        return out

    def wait_heartbeat(self, timeout: float = 10.0) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for f in self.frames(0.3):
                if f[0].startswith(b"kvstored-heartbeat@") and len(f) == 4:
                    return msgpack.unpackb(f[3], strict_map_key=False)  # type: ignore[no-any-return]
        raise AssertionError("no heartbeat")

    def ask(self, request: bytes) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", request])
            out = []
            for _ in range(10000):
                assert dealer.poll(10000), "no answer from the replay socket"
                _, seq, payload = dealer.recv_multipart()
                if decode_seq(seq) == END_OF_REPLAY:
                    return out
                out.append((decode_seq(seq), payload))
            raise AssertionError("replay never ended")
        finally:
            dealer.close(0)

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def data_events(frames: list[list[bytes]]) -> list[tuple[str, int, object]]:
    out = []
    for f in frames:
        if f[0].startswith(b"kv@"):
            for e in decode_batch(f[2]).events:
                out.append((f[0].decode(), decode_seq(f[1]), e))
    return out


def test_a_daemon_publishes_what_it_stores_and_drops_in_vllm_format(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, *events_args(tmp_path))
    consumer = Consumer(tmp_path)
    client = kvstored.Client(daemon.socket, namespace=kvstored.Namespace(model="m-events"))
    try:
        hb = consumer.wait_heartbeat()
        assert hb["node"] == "n1" and hb["epoch"] >= 1
        tokens = np.arange(16 * 5)
        hashes = kvstored.block_hashes(tokens)
        client.save(tokens, np.ones((5, BLOCK), np.uint8))
        got = data_events(consumer.frames(1.0))
        stored = [(t, e) for t, _, e in got if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert len(stored) == 1   # one chain saved: one event
        topic, event = stored[0]
        assert topic == "kv@n1@m-events"
        assert isinstance(event, BlockStored)
        assert event.block_hashes == tuple(int.from_bytes(h[-8:], "big") for h in hashes)
        assert event.parent_block_hash is None and event.block_size == 16
        seqs = [s for _, s, _ in got]
        assert {epoch_of(s) for s in seqs} == {hb["epoch"]}
        client.flush()   # (the write-back may have written some already)
        got += data_events(consumer.frames(1.0))
        disk = [e for _, _, e in got if isinstance(e, BlockStored) and e.medium == "DISK"]
        assert sorted(h for e in disk for h in e.block_hashes) == sorted(event.block_hashes)
        assert client.evict(tier="dram") == 5
        got = data_events(consumer.frames(1.0))
        removed = [h for _, _, e in got if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes]
        assert sorted(removed) == sorted(event.block_hashes)

        # replay from the first batch: everything since the start, AllBlocksCleared first
        replay = consumer.ask(encode_seq(hb["epoch"] << 40))
        first = decode_batch(replay[0][1]).events
        assert replay[0][0] == hb["epoch"] << 40 and first == (AllBlocksCleared(),)
        assert [s for s, _ in replay] == sorted(s for s, _ in replay)
        # a snapshot: cleared, then the five blocks on disk only
        snap = consumer.ask(SNAPSHOT_REQUEST)
        events = [e for _, p in snap for e in decode_batch(p).events]
        assert events[0] == AllBlocksCleared()
        assert {(h, e.medium) for e in events[1:] if isinstance(e, BlockStored) for h in e.block_hashes} \
            == {(h, "DISK") for h in event.block_hashes}
        assert {s for s, _ in snap} == {replay[-1][0]}   # it follows the last batch numbered
    finally:
        client.close()
        consumer.close()
        assert daemon.stop() == 0, daemon.log()[-3000:]


def test_a_restart_changes_the_epoch_and_restored_blocks_are_announced(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, *events_args(tmp_path))
    consumer = Consumer(tmp_path)
    client = kvstored.Client(daemon.socket, namespace=kvstored.Namespace(model="m-restart"))
    try:
        epoch = consumer.wait_heartbeat()["epoch"]
        tokens = np.arange(16 * 3)
        client.save(tokens, np.ones((3, BLOCK), np.uint8))
        client.flush()
        client.close()
        assert daemon.stop() == 0
        consumer.frames(0.5)   # what the old daemon sent before it stopped
        daemon = start_daemon(tmp_path, *events_args(tmp_path))
        hb = consumer.wait_heartbeat()
        assert hb["epoch"] != epoch
        replay = consumer.ask(encode_seq(hb["epoch"] << 40))
        events = [e for _, p in replay for e in decode_batch(p).events]
        assert events[0] == AllBlocksCleared()
        want = {int.from_bytes(h[-8:], "big") for h in kvstored.block_hashes(tokens)}
        assert {h for e in events if isinstance(e, BlockStored) and e.medium == "DISK" for h in e.block_hashes} == want
    finally:
        consumer.close()
        assert daemon.stop() == 0, daemon.log()[-3000:]


@pytest.mark.parametrize("setting", ["events.endpoint=tcp://0.0.0.0:5557", "events.hash_format=hex"])
def test_bad_events_settings_are_refused_naming_the_key(tmp_path: Path, setting: str) -> None:
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "kvstored", "--no-config", "--set", "events.enabled=true",
                           "--set", setting, "--print-config"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and setting.split("=")[0] in proc.stderr, proc.stderr
