"""Transports side by side (issue 30): the daemon's own protobuf messages over gRPC on a Unix
socket, ZeroMQ over ipc://, and length-prefixed frames on a Unix socket under uvloop, beside the
raw-socket floor (the same bytes each way, no protobuf at either end).

    python -m tools.bench transports [--calls 1000] [--runs 5] [--clients 4] [--warmup 100]
                                     [--messages lookup1,lookup2048,stats] [--transports ...] [--out DIR]

Every server runs in a process of its own and does the same work per call (:func:`handle`: parse
the request, build the response, serialize it), so a row differs from another by its transport
only. The gRPC server is set up as the daemon's (``grpc.aio`` under uvloop, the daemon's server
options); the ZeroMQ and frame servers are asyncio under uvloop too (and ZeroMQ once more in a
blocking loop, to tell ZeroMQ's own cost from its asyncio integration's); the floor's server is a
blocking thread per connection answering with canned bytes. Clients are sync, as the SDK is, and
processes of their own: one alone (sequential), then ``--clients`` at once, each making
``--calls`` calls after ``--warmup``. Each client checks that the request it encodes is the one
it was given and that the first answer to every message is :func:`handle`'s, byte for byte. A
row with no transport (the encode, the handler and the parse in one process) tells what of each
row is the messages' own cost. The tables give the median over ``--runs`` of each run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import uvloop
import zmq
import zmq.asyncio

from kvstored_client.contract.proto import kvstored_pb2 as pb
from tools.bench.common import REPO_ROOT, Procs, percentile, python_env, wait_for, write_json

LOOKUP, STATS = 1, 2
GRPC_METHODS = {LOOKUP: "Lookup", STATS: "Stats"}
SERVICE = "kvstored.v1.KVStore"
DIGEST = 32   # sha256_cbor, the namespaces' default hash
# A request frame: body length, method; a response frame: body length, status (0: ok).
HEADER = struct.Struct("<IB")
BLOCK_BYTES = 256 << 10
# Offsets spread over a 16 GiB arena, so their varints are as long as a real lease's.
OFFSETS = [(i * 7919 % 65536) * BLOCK_BYTES for i in range(8192)]
SESSION = "3f2b8c1e-5d4a-4e6f-9a7b-1c2d3e4f5a6b"   # a session id as the daemon makes them

# name -> (label, blocks); blocks None: Stats
MESSAGES: dict[str, tuple[str, int | None]] = {
    "lookup1": ("Lookup, 1 block, leased", 1),
    "lookup2048": ("Lookup, 2,048 blocks (a 32k-token prompt), leased", 2048),
    "stats": ("Stats", None),
}
# name -> row label; the floor first, gRPC (today's) last
TRANSPORTS = {
    "raw": "raw Unix socket floor (same bytes, no protobuf)",
    "frames": "frames on a Unix socket (uvloop streams)",
    "frames-protocol": "frames on a Unix socket (uvloop Protocol)",
    "zmq": "ZeroMQ REQ/ROUTER over ipc:// (zmq.asyncio, uvloop)",
    "zmq-blocking": "ZeroMQ REQ/ROUTER over ipc:// (blocking server loop, no event loop)",
    "grpc": "gRPC unary on a Unix socket (grpc.aio, uvloop)",
}

IN_PROCESS = "no transport: encode, handler, parse in one process"


def request(name: str) -> tuple[int, bytes]:
    """(method, serialized request) of message ``name``, as the SDK sends it."""
    blocks = MESSAGES[name][1]
    if blocks is None:
        return STATS, pb.StatsRequest().SerializeToString()
    hashes = b"".join(i.to_bytes(4, "big") * (DIGEST // 4) for i in range(blocks))
    req = pb.LookupRequest(namespace_id=7, keys=pb.BlockKeys(packed_hashes=hashes), lease=True, session_id=SESSION)
    return LOOKUP, req.SerializeToString()


def _stats() -> pb.StatsResponse:
    tiers = [pb.TierStats(name="dram", capacity_bytes=64 << 30, used_bytes=41 << 30, blocks=164_000, evictions=9_100),
             pb.TierStats(name="ssd", capacity_bytes=2 << 40, used_bytes=700 << 30, blocks=2_800_000,
                          evictions=51_000, write_errors=0, read_errors=1)]
    return pb.StatsResponse(version="0.9.0", uptime_s=86_400.5, tiers=tiers, lookups=12_345_678,
                            lookup_blocks=987_654_321, hit_blocks=456_789_012, hit_tokens=7_308_624_192,
                            saved_blocks=3_000_000, active_leases=12, clients=8, namespaces=2,
                            index_blocks=2_964_000, promotions=40_000, demotions=2_900_000, dropped_blocks=51_000,
                            dropped_blocks_by_reason={"ssd_full": 50_000, "corrupt": 1, "refused": 999},
                            room_waits=17, room_wait_seconds=0.42)


def handle(method: int, body: bytes) -> bytes:
    """The one handler every server runs: parse the request, build the response, serialize it."""
    if method == LOOKUP:
        req = pb.LookupRequest.FromString(body)
        n = len(req.keys.packed_hashes) // DIGEST
        resp = pb.LookupResponse(hit_blocks=n, tiers=[pb.TIER_DRAM] * n, offsets=OFFSETS[:n] if req.lease else (),
                                 lease_id=(req.namespace_id << 32) | n if req.lease else 0, lease_ttl_ms=30_000,
                                 block_bytes=BLOCK_BYTES, block_size=16)
        return resp.SerializeToString(deterministic=True)
    if method == STATS:
        pb.StatsRequest.FromString(body)
        return _stats().SerializeToString(deterministic=True)
    raise ValueError(f"unknown method {method}")


def request_message(method: int, body: bytes) -> Any:
    return (pb.LookupRequest if method == LOOKUP else pb.StatsRequest).FromString(body)


def parse(method: int, body: bytes) -> Any:
    return (pb.LookupResponse if method == LOOKUP else pb.StatsResponse).FromString(body)


# -- servers (each in its own process: python -m tools.bench.transports serve KIND PATH) ----------
def _identity(b: bytes) -> bytes:
    return b


async def _orphan_watch() -> None:
    """Ends the server when the harness that started it is gone (killed before it could stop it)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    os._exit(0)


async def serve_grpc(path: str) -> None:
    from kvstored.server.app import MAX_MESSAGE_BYTES

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])

    def unary(method: int) -> grpc.RpcMethodHandler:
        async def call(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return handle(method, body)
        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=_identity,
                                                   response_serializer=_identity)

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {name: unary(m) for m, name in GRPC_METHODS.items()}),))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    await _orphan_watch()


async def serve_zmq(path: str) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    asyncio.get_running_loop().create_task(_orphan_watch())
    while True:
        # from a REQ socket: [its identity, b"", method, body]
        *route, method, body = await sock.recv_multipart()
        await sock.send_multipart([*route, handle(method[0], body)])


def serve_zmq_blocking(path: str) -> None:
    """Not a server the daemon could run (its calls live on the event loop): it tells what of the
    ZeroMQ row is ZeroMQ's own I/O threads and what its asyncio integration adds."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    parent = os.getppid()
    sock.setsockopt(zmq.RCVTIMEO, 500)
    while os.getppid() == parent:
        try:
            *route, method, body = sock.recv_multipart()
        except zmq.Again:
            continue
        sock.send_multipart([*route, handle(method[0], body)])


async def serve_frames(path: str) -> None:
    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                n, method = HEADER.unpack(await reader.readexactly(HEADER.size))
                out = handle(method, await reader.readexactly(n))
                writer.write(HEADER.pack(len(out), 0) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    await asyncio.start_unix_server(conn, path)
    await _orphan_watch()


class FrameProtocol(asyncio.Protocol):
    """Frames parsed straight off ``data_received``: no stream reader, no task per connection."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.buf:   # the rest of a frame that came in pieces
            self.buf += data
            data = bytes(self.buf)
            self.buf.clear()
        off = 0
        while len(data) - off >= HEADER.size:
            n, method = HEADER.unpack_from(data, off)
            end = off + HEADER.size + n
            if end > len(data):
                break
            out = handle(method, data[off + HEADER.size:end])
            self.transport.write(HEADER.pack(len(out), 0) + out)
            off = end
        if off < len(data):
            self.buf += data[off:]


async def serve_frames_protocol(path: str) -> None:
    await asyncio.get_running_loop().create_unix_server(FrameProtocol, path)
    await _orphan_watch()


def serve_raw(path: str) -> None:
    """The floor: a blocking thread per connection reads a frame and sends back the bytes of
    :func:`handle`'s answer, computed once per request size and reused."""
    canned: dict[tuple[int, int], bytes] = {}
    lock = threading.Lock()

    def conn_loop(conn: socket.socket) -> None:
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        with conn:
            while True:
                got, need = 0, HEADER.size
                while got < need:
                    k = conn.recv_into(view[got:])
                    if k == 0:
                        return
                    got += k
                    if need == HEADER.size and got >= HEADER.size:
                        need += HEADER.unpack_from(buf)[0]
                n, method = HEADER.unpack_from(buf)
                reply = canned.get((method, n))
                if reply is None:
                    with lock:
                        out = handle(method, bytes(view[HEADER.size:need]))
                        reply = canned[(method, n)] = HEADER.pack(len(out), 0) + out
                conn.sendall(reply)

    def orphan_watch(parent: int) -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphan_watch, args=(os.getppid(),), daemon=True).start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(64)
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=conn_loop, args=(conn,), daemon=True).start()


ASYNC_SERVERS: dict[str, Callable[[str], Any]] = {
    "grpc": serve_grpc, "zmq": serve_zmq, "frames": serve_frames, "frames-protocol": serve_frames_protocol}


def serve(kind: str, path: str) -> None:
    if kind == "raw":
        serve_raw(path)
    elif kind == "zmq-blocking":
        serve_zmq_blocking(path)
    else:
        uvloop.run(ASYNC_SERVERS[kind](path))


# -- clients (sync, as the SDK) ---------------------------------------------------------------
class GrpcClient:
    def __init__(self, path: str) -> None:
        from kvstored_client.connection import MAX_MESSAGE_BYTES, MAX_RECONNECT_BACKOFF_MS, RECONNECT_BACKOFF_MS

        self.channel = grpc.insecure_channel(f"unix:{path}", options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)])
        self.calls = {m: self.channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=_identity,
                                                  response_deserializer=_identity)
                      for m, name in GRPC_METHODS.items()}

    def call(self, method: int, body: bytes) -> bytes:
        out: bytes = self.calls[method](body, timeout=10)   # the SDK sets a deadline on every call
        return out

    def close(self) -> None:
        self.channel.close()


class ZmqClient:
    def __init__(self, path: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.connect(f"ipc://{path}")
        self.methods = {m: bytes([m]) for m in GRPC_METHODS}

    def call(self, method: int, body: bytes) -> bytes:
        self.sock.send_multipart([self.methods[method], body])
        return self.sock.recv()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class FrameClient:
    """A blocking Unix socket: one ``sendall`` of the frame, ``recv_into`` until the answer is whole."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.buf = bytearray(4 << 20)
        self.view = memoryview(self.buf)

    def call(self, method: int, body: bytes) -> bytes:
        self.sock.sendall(HEADER.pack(len(body), method) + body)
        got, need = 0, HEADER.size
        while got < need:
            k = self.sock.recv_into(self.view[got:])
            if k == 0:
                raise ConnectionError("the server closed the connection")
            got += k
            if need == HEADER.size and got >= HEADER.size:
                n, status = HEADER.unpack_from(self.buf)
                if status != 0:
                    raise RuntimeError(f"status {status}")
                need += n
        return bytes(self.view[HEADER.size:need])

    def close(self) -> None:
        self.sock.close()


CLIENTS: dict[str, Callable[[str], Any]] = {
    "grpc": GrpcClient, "zmq": ZmqClient, "zmq-blocking": ZmqClient,
    "frames": FrameClient, "frames-protocol": FrameClient, "raw": FrameClient}


def one_call(kind: str, client: Any, method: int, body: bytes) -> Callable[[], bytes]:
    """One call as the SDK makes it: encode the request, send it, parse the answer (the floor
    sends the same bytes and parses nothing)."""
    if kind == "raw":
        def floor() -> bytes:
            out: bytes = client.call(method, body)
            return out
        return floor
    msg = request_message(method, body)

    def one() -> bytes:
        out: bytes = client.call(method, msg.SerializeToString())
        parse(method, out)
        return out
    return one


def client_worker() -> None:
    """A client process driven by the harness over stdin/stdout, one JSON line per job: warm up
    (checking the first answer), say ``ready``, wait for ``go``, make the calls, print the timings."""
    clients: dict[str, Any] = {}
    try:
        for line in sys.stdin:
            job = json.loads(line)
            kind = job["transport"]
            if kind not in clients:
                clients[kind] = CLIENTS[kind](job["path"])
            client = clients[kind]
            method, body = request(job["message"])
            expected = handle(method, body)
            one = one_call(kind, client, method, body)
            exact = one() == expected and request_message(method, body).SerializeToString() == body
            for _ in range(job["warmup"]):
                one()
            print("ready", flush=True)
            if sys.stdin.readline().strip() != "go":
                return
            lat = []
            t_start = time.monotonic()
            for _ in range(job["calls"]):
                t0 = time.perf_counter()
                one()
                lat.append(time.perf_counter() - t0)
            t_end = time.monotonic()
            print(json.dumps({"lat": lat, "start": t_start, "end": t_end, "exact": exact,
                              "request_bytes": len(body), "response_bytes": len(expected)}), flush=True)
    finally:
        for c in clients.values():
            c.close()


# -- the harness ------------------------------------------------------------------------------
class InProcess:
    """No transport: the handler called directly, so a row less this one is what its transport costs."""

    def __init__(self, path: str = "") -> None:
        pass

    def call(self, method: int, body: bytes) -> bytes:
        return handle(method, body)

    def close(self) -> None:
        pass


def in_process(message: str, calls: int, warmup: int) -> dict[str, float]:
    """One run of the SDK's encode, the handler and the SDK's parse in this process."""
    method, body = request(message)
    one = one_call("inproc", InProcess(), method, body)
    for _ in range(warmup):
        one()
    lat = []
    t_start = time.monotonic()
    for _ in range(calls):
        t0 = time.perf_counter()
        one()
        lat.append(time.perf_counter() - t0)
    return figures([{"lat": lat, "start": t_start, "end": time.monotonic()}])


class Workers:
    """``n`` client processes; a job runs on the first ``k`` of them at once."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-m", "tools.bench.transports", "client"], cwd=REPO_ROOT,
                                       env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(n)]

    def _line(self, proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client process exited with status {proc.wait(10)}")
        return line

    def run(self, k: int, job: dict[str, Any]) -> list[dict[str, Any]]:
        procs = self.procs[:k]
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
        for proc in procs:   # every client warmed up and connected before any starts
            if self._line(proc).strip() != "ready":
                raise RuntimeError("client process out of step")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        return [json.loads(self._line(proc)) for proc in procs]

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def figures(results: list[dict[str, Any]]) -> dict[str, float]:
    """One run's figures over its clients: latency percentiles (µs) and calls/s over the span
    from the first client's start to the last one's end."""
    lat = [x for r in results for x in r["lat"]]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"p50_us": percentile(lat, 50) * 1e6, "p90_us": percentile(lat, 90) * 1e6,
            "p99_us": percentile(lat, 99) * 1e6, "calls_per_s": len(lat) / span}


def _connectable(path: str) -> Callable[[], bool]:
    def check() -> bool:
        if not os.path.exists(path):
            return False
        with socket.socket(socket.AF_UNIX) as s:
            return s.connect_ex(path) == 0
    return check


def measure(a: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Start a server per transport and the clients, run every (message, transport) ``a.runs``
    times, alone and with ``a.clients`` clients; the per-run figures and their medians."""
    transports = [t for t in TRANSPORTS if t in a.transports.split(",")]
    messages = [m for m in MESSAGES if m in a.messages.split(",")]
    tmp = tempfile.mkdtemp(prefix="kvbench-transports-")
    runs: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {
        m: {t: {"alone": [], "together": []} for t in transports} for m in messages}
    sizes: dict[str, dict[str, int]] = {}
    exact: dict[str, dict[str, bool]] = {m: {} for m in messages}
    inproc: dict[str, list[dict[str, float]]] = {m: [] for m in messages}
    with Procs() as procs:
        workers: Workers | None = None
        try:
            paths = {}
            for t in transports:
                paths[t] = str(Path(tmp) / f"{t}.sock")
                proc = procs.start(t, [sys.executable, "-m", "tools.bench.transports", "serve", t, paths[t]],
                                   log=Path(tmp) / f"{t}.log", cwd=REPO_ROOT, env=python_env())
                # a ZeroMQ socket accepts only ZeroMQ's handshake; its file is there once it is bound
                ready = (lambda p=paths[t]: os.path.exists(p)) if t.startswith("zmq") else _connectable(paths[t])
                wait_for(ready, 60, f"{t} server", proc)
            workers = Workers(max(1, a.clients))
            for rep in range(a.runs):
                log(f"run {rep + 1} of {a.runs}")
                # transports interleaved within a run, so that a burst of load on the machine lands on all
                for m in messages:
                    inproc[m].append(in_process(m, a.calls, a.warmup))
                    for t in transports:
                        job = {"transport": t, "path": paths[t], "message": m, "calls": a.calls, "warmup": a.warmup}
                        alone = workers.run(1, job)
                        together = workers.run(a.clients, job) if a.clients > 1 else alone
                        sizes[m] = {"request": alone[0]["request_bytes"], "response": alone[0]["response_bytes"]}
                        exact[m][t] = exact[m].get(t, True) and all(r["exact"] for r in alone + together)
                        runs[m][t]["alone"].append(figures(alone))
                        runs[m][t]["together"].append(figures(together))
        finally:
            if workers is not None:
                workers.close()
            procs.stop_all()
            shutil.rmtree(tmp, ignore_errors=True)
    median = {m: {t: {mode: {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}
                          for mode, per_run in by_mode.items()}
                      for t, by_mode in by_t.items()}
              for m, by_t in runs.items()}
    handler = {m: {k: statistics.median(r[k] for r in per_run) for k in per_run[0]} for m, per_run in inproc.items()}
    return {"calls": a.calls, "warmup": a.warmup, "runs": a.runs, "clients": a.clients, "transports": transports,
            "labels": {t: TRANSPORTS[t] for t in transports}, "messages": {m: MESSAGES[m][0] for m in messages},
            "sizes": sizes, "exact": exact, "median": median, "per_run": runs,
            "in_process": handler}


def markdown(res: dict[str, Any]) -> str:
    k = res["clients"]
    lines = [f"Median of {res['runs']} runs; each run {res['calls']} calls per client after {res['warmup']} "
             f"warm-up calls; 1 client, then {k} clients at once (each a process; calls/s: all clients together)."]
    for m, label in res["messages"].items():
        size = res["sizes"][m]
        lines += ["", f"### {label} (request {size['request']:,} B, response {size['response']:,} B)", "",
                  f"| transport | p50 µs | p90 µs | p99 µs | calls/s | {k} clients p50 µs | {k} clients p90 µs | "
                  f"{k} clients p99 µs | {k} clients calls/s | p50 x gRPC | p50 x floor | bit-exact |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        med = res["median"][m]
        grpc_p50 = med["grpc"]["alone"]["p50_us"] if "grpc" in med else None
        floor_p50 = med["raw"]["alone"]["p50_us"] if "raw" in med else None
        h = res["in_process"][m]
        lines.append(f"| {IN_PROCESS} | {h['p50_us']:.0f} | {h['p90_us']:.0f} | {h['p99_us']:.0f} | "
                     f"{h['calls_per_s']:,.0f} | — | — | — | — | — | — | — |")
        for t in res["transports"]:
            one, many = med[t]["alone"], med[t]["together"]
            x_grpc = f"{one['p50_us'] / grpc_p50:.2f}" if grpc_p50 else "—"
            x_floor = f"{one['p50_us'] / floor_p50:.2f}" if floor_p50 else "—"
            lines.append(f"| {res['labels'][t]} | {one['p50_us']:.0f} | {one['p90_us']:.0f} | {one['p99_us']:.0f} | "
                         f"{one['calls_per_s']:,.0f} | {many['p50_us']:.0f} | {many['p90_us']:.0f} | "
                         f"{many['p99_us']:.0f} | {many['calls_per_s']:,.0f} | {x_grpc} | {x_floor} | "
                         f"{'yes' if res['exact'][m][t] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench transports", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000, help="timed calls per client per run")
    p.add_argument("--warmup", type=int, default=100, help="calls per client before each timed run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--clients", type=int, default=4, help="clients at once in the concurrent rows")
    p.add_argument("--messages", default=",".join(MESSAGES), help=f"comma-separated subset of {','.join(MESSAGES)}")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    p.add_argument("--out", default="", help="also write results.json and results.md into this directory")
    a = p.parse_args(argv)
    unknown = (set(a.messages.split(",")) - set(MESSAGES)) | (set(a.transports.split(",")) - set(TRANSPORTS))
    if unknown or a.calls < 1 or a.runs < 1 or a.clients < 1 or a.warmup < 0:
        p.error(f"unknown names {sorted(unknown)}" if unknown else "--calls, --runs, --clients must be positive")

    def log(msg: str) -> None:
        print(f"[transports {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    res = measure(a, log)
    res["load_average"] = os.getloadavg()
    text = markdown(res)
    print(text, end="")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "results.json", res)
        (out / "results.md").write_text(text)
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "serve":
    serve(sys.argv[2], sys.argv[3])
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "client":
    client_worker()
elif __name__ == "__main__":
    raise SystemExit(main())
