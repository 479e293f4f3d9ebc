"""Hostile requests against a kvstored, on every method of the KVStore service.

    python -m tools.fuzz --requests 10000 [--socket PATH] [--seed N] [--timeout-s 10] [--transport frames]

Fires random requests (random bytes, truncated messages, huge repeated fields, wrong-length
hashes, other sessions' ids) at the daemon on ``--socket``, or at one it starts in a temporary
directory, through a generic stub that sends raw bytes, as a client that is not the SDK would. It
reports crashes (the daemon exited), hangs (calls still unanswered at their deadline), the statuses
by method, statuses the README's table does not document for the method, and the daemon's RSS
before and after. Exit status 1 when there was a crash, a hang or an undocumented status.

The methods are read from the proto's descriptor: a new RPC is fuzzed without a change here.
With ``--transport frames`` the same requests go to the methods the fast path carries, in its
frames on the daemon's fast socket, mixed with frames that cannot be requests (too long, a bad
deadline budget, an unknown method, cut short, random bytes): those must end with
``UNIMPLEMENTED`` or the connection closed (``CLOSED``), and the daemon must keep serving.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvstored
from kvstored_client.contract import frames
from kvstored_client.contract.proto import kvstored_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
KINDS = ("random", "truncated", "huge", "wrong_hash", "foreign")
HUGE_ELEMENTS = 1 << 20         # elements of a huge repeated scalar field (a few MiB on the wire)
HUGE_BYTES_ELEMENTS = 1 << 16   # elements of a huge repeated bytes or message field
MAX_DEPTH = 3
# Statuses gRPC gives any call, whatever the method: named once in the README's table.
EVERY_CALL = "(every call)"
STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)
TRANSPORTS = ("grpc", "frames")
# Frames that cannot be requests, and what they may end with (the connection closed, or
# UNIMPLEMENTED for a method id the fast path does not carry).
FRAME = "(a fast-path frame)"   # its row in the README's table
FRAME_KINDS = ("oversized_frame", "bad_budget", "unknown_method", "cut_frame", "random_bytes", "one_way")
# ONE_WAY_UNANSWERED: a one-way frame got no answer and the call after it on the connection did
FRAME_OUTCOMES = frozenset({"CLOSED", "UNIMPLEMENTED", "ONE_WAY_UNANSWERED"})
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def methods(transport: str = "grpc") -> list[MethodDescriptor]:
    """The methods a ``transport`` carries: gRPC all of the service's, frames the fast path's."""
    return [m for m in SERVICE.methods if transport == "grpc" or m.name in frames.METHOD_IDS]


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


@dataclass(frozen=True, slots=True)
class Ids:
    """Ids a hostile client may send: its own session's, another session's (``victim_*``),
    and the namespace both use."""

    session: str = ""
    namespace: int = 0
    victim_session: str = ""
    victim_leases: tuple[int, ...] = ()
    victim_buffers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    method: MethodDescriptor
    kind: str
    bodies: tuple[bytes, ...]   # one for a unary request, one or more for a streamed one


class Requests:
    """Hostile request bodies for ``ids``, from ``rng``."""

    def __init__(self, rng: random.Random, ids: Ids) -> None:
        self._rng = rng
        self._ids = ids
        self._huge: dict[str, bytes] = {}   # built once per method: a huge message costs seconds

    def make(self, method: MethodDescriptor, kind: str) -> Request:
        n = self._rng.randint(1, 3) if method.client_streaming else 1
        return Request(method, kind, tuple(self._body(method.input_type, kind) for _ in range(n)))

    def _body(self, desc: Descriptor, kind: str) -> bytes:
        rng = self._rng
        if kind == "random":
            return rng.randbytes(rng.choice((1, 2, 3, 8, 32, 256, 4096)))
        if kind == "huge":
            if desc.full_name not in self._huge:
                self._huge[desc.full_name] = self._inflated(self._message(desc, 0)).SerializeToString()
            return self._huge[desc.full_name]
        msg = self._message(desc, 0, wrong_hash=kind == "wrong_hash", foreign=kind == "foreign")
        raw = msg.SerializeToString()
        if kind == "truncated":
            raw = raw[:rng.randrange(len(raw))] if raw else b"\x0a"
        return raw

    def _inflated(self, msg: Message) -> Message:
        """``msg`` with one of its repeated fields (its own or a sub-message's) made huge."""
        found: list[tuple[Message, Any]] = []   # (the upb FieldDescriptor is not the stubs' class)

        def walk(m: Message, depth: int) -> None:
            for f in m.DESCRIPTOR.fields:
                if f.is_repeated:
                    found.append((m, f))
                elif f.type == FieldDescriptor.TYPE_MESSAGE and depth < MAX_DEPTH:
                    walk(getattr(m, f.name), depth + 1)
        walk(msg, 0)
        if not found:
            return msg
        parent, f = self._rng.choice(found)
        values = getattr(parent, f.name)
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            sub = GetMessageClass(_sub(f))()
            values.extend([sub] * HUGE_BYTES_ELEMENTS)
        else:
            count = HUGE_BYTES_ELEMENTS if f.type in (FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING) \
                else HUGE_ELEMENTS
            values.extend([self._scalar(f, False, False)] * count)
        return msg

    def _message(self, desc: Descriptor, depth: int, *, wrong_hash: bool = False, foreign: bool = False) -> Message:
        msg = GetMessageClass(desc)()
        for f in desc.fields:
            if self._rng.random() < 0.25 and not wrong_hash:
                continue
            repeated = f.is_repeated
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                if depth >= MAX_DEPTH:
                    continue
                sub = self._message(_sub(f), depth + 1, wrong_hash=wrong_hash, foreign=foreign)
                if repeated:
                    getattr(msg, f.name).extend([sub] * self._rng.randint(0, 3))
                else:
                    getattr(msg, f.name).CopyFrom(sub)
                continue
            if repeated:
                getattr(msg, f.name).extend(self._scalar(f, wrong_hash, foreign)
                                            for _ in range(self._rng.randint(0, 20)))
            else:
                setattr(msg, f.name, self._scalar(f, wrong_hash, foreign))
        return msg

    def _scalar(self, f: FieldDescriptor, wrong_hash: bool, foreign: bool) -> object:
        rng, ids = self._rng, self._ids
        if f.type == FieldDescriptor.TYPE_STRING:
            if f.name.endswith("session_id"):
                return rng.choice((ids.victim_session, ids.victim_session, ids.session, "", "x" * 64)) \
                    if foreign else rng.choice((ids.session, ids.victim_session, "", "no-such-session"))
            return rng.choice(("", "a", "../../../../etc/passwd", "/dev/shm/x", "x" * 5000, "model",
                               "\u00e9\u4e2d\U0001f600", "127.0.0.1:1", "sha256_cbor", "float16", "nul\x00byte"))
        if f.type == FieldDescriptor.TYPE_BYTES:
            if wrong_hash or (f.name in ("hashes", "packed_hashes") and rng.random() < 0.5):
                return rng.randbytes(rng.choice((0, 1, 3, 16, 31, 33, 64, 65)))
            return rng.randbytes(rng.choice((0, 4, 32, 64)))
        if f.type == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if f.type == FieldDescriptor.TYPE_ENUM:
            assert f.enum_type is not None
            return rng.choice([v.number for v in f.enum_type.values] + [99, -1])
        if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return rng.choice((0.0, -1.0, 1e308, float("nan"), float("inf")))
        signed = f.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT32,
                            FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED32,
                            FieldDescriptor.TYPE_SFIXED64)
        wide = f.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64)
        top = (1 << (63 if signed else 64)) - 1 if wide else (1 << (31 if signed else 32)) - 1
        pool = [0, 1, 2, 15, 16, 512, 4096, top]
        if signed:
            pool += [-1, -top - 1]
        if foreign or rng.random() < 0.5:
            pool += [ids.namespace, *ids.victim_leases, *ids.victim_buffers]
        value = rng.choice(pool)
        return value if -top - 1 <= value <= top else 0


def _sub(f: FieldDescriptor) -> Descriptor:
    assert f.message_type is not None
    return f.message_type


@dataclass(frozen=True, slots=True)
class Outcome:
    method: str
    kind: str
    status: str        # "OK", a status code's name, or "HANG" (no answer by the deadline)
    seconds: float


def _same(b: bytes) -> bytes:
    return b


def fire(channel: grpc.Channel, request: Request, timeout_s: float) -> Outcome:
    """Send ``request`` and read its whole answer; a deadline passed here is a hang."""
    m = request.method
    start = time.monotonic()
    status = "OK"
    try:
        if m.client_streaming and m.server_streaming:
            for _ in channel.stream_stream(path(m), request_serializer=_same, response_deserializer=_same)(
                    iter(request.bodies), timeout=timeout_s):
                pass
        elif m.client_streaming:
            channel.stream_unary(path(m), request_serializer=_same, response_deserializer=_same)(
                iter(request.bodies), timeout=timeout_s)
        elif m.server_streaming:
            for _ in channel.unary_stream(path(m), request_serializer=_same, response_deserializer=_same)(
                    request.bodies[0], timeout=timeout_s):
                pass
        else:
            channel.unary_unary(path(m), request_serializer=_same, response_deserializer=_same)(
                request.bodies[0], timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        status = code.name if code is not None else "UNKNOWN"
    seconds = time.monotonic() - start
    if status == "DEADLINE_EXCEEDED" and seconds >= timeout_s:
        status = "HANG"
    return Outcome(m.name, request.kind, status, seconds)


def _frame_answer(sock: socket.socket, request_id: int = 0) -> str:
    """The status name of the first answer on ``sock``, or CLOSED when it ends first (with
    ``request_id``: ANSWERED_OTHER when the answer is to another request)."""
    header = sock.recv(frames.ANSWER.size, socket.MSG_WAITALL)
    if len(header) < frames.ANSWER.size:
        return "CLOSED"
    length, answered, code = frames.ANSWER.unpack(header)
    if length and len(sock.recv(length, socket.MSG_WAITALL)) < length:
        return "CLOSED"
    if request_id and answered != request_id:
        return "ANSWERED_OTHER"
    return "OK" if code == frames.OK else _CODE_NAMES.get(code, "UNKNOWN")


def fire_frames(fast_socket: str, request: Request, timeout_s: float) -> Outcome:
    """``request`` (a unary method the fast path carries) in a frame on a connection of its own."""
    start = time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(fast_socket)
            body = request.bodies[0]
            sock.sendall(frames.REQUEST.pack(len(body), frames.METHOD_IDS[request.method.name], 1, timeout_s) + body)
            status = _frame_answer(sock)
        except TimeoutError:
            status = "HANG"
        except OSError:
            status = "CLOSED"
    return Outcome(request.method.name, request.kind, status, time.monotonic() - start)


def bad_frame(rng: random.Random, kind: str) -> bytes:
    """Bytes of ``kind`` (one of FRAME_KINDS) that are no well-formed request."""
    body = rng.randbytes(rng.randrange(0, 64))
    if kind == "oversized_frame":
        return frames.REQUEST.pack(frames.MAX_PAYLOAD_BYTES + 1 + rng.randrange(1 << 20), 1, 1, 1.0) + body
    if kind == "bad_budget":
        return frames.REQUEST.pack(len(body), 1, 1, rng.choice((float("nan"), float("inf"), -1.0))) + body
    if kind == "unknown_method":
        method = rng.choice([i for i in range(frames.ONE_WAY) if i not in frames.METHODS])
        return frames.REQUEST.pack(len(body), method, 1, 1.0) + body
    if kind == "one_way":   # any method, never answered; then a call that is (request 2)
        method = rng.randrange(frames.ONE_WAY) | frames.ONE_WAY
        return (frames.REQUEST.pack(len(body), method, 1, 1.0) + body
                + frames.REQUEST.pack(0, frames.METHOD_IDS["Stats"], 2, 10.0))
    if kind == "cut_frame":
        return frames.REQUEST.pack(len(body) + 1 + rng.randrange(1000), 1, 1, 1.0) + body
    return rng.randbytes(rng.randrange(1, 256))


def fire_bad_frame(fast_socket: str, data: bytes, kind: str, timeout_s: float) -> Outcome:
    """Send ``data`` and end the sending side (so a frame cut short ends there): the daemon must
    answer (UNIMPLEMENTED) or close the connection, not leave it hanging."""
    start = time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(fast_socket)
            sock.sendall(data)
            if kind not in ("unknown_method", "one_way"):
                sock.shutdown(socket.SHUT_WR)
            status = _frame_answer(sock, 2) if kind == "one_way" else _frame_answer(sock)
            if kind == "one_way" and status == "OK":
                status = "ONE_WAY_UNANSWERED"
        except TimeoutError:
            status = "HANG"
        except OSError:
            status = "CLOSED"
    return Outcome(FRAME, kind, status, time.monotonic() - start)


def documented_statuses(readme: str) -> dict[str, frozenset[str]]:
    """The README's table of statuses by call: {RPC name: status code names}; a row "as OTHER"
    has OTHER's, and the row ``(every call)`` is joined to every other."""
    section = readme.split("### Statuses by call", 1)[1].split("\n#", 1)[0]
    rows: dict[str, frozenset[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not line.startswith("|") or set(cells[0]) <= {"-", " "} or cells[0] == "RPC":
            continue
        same = re.fullmatch(r"as (\w+)", cells[1])
        named = set(re.findall(r"`([A-Z_]+)`", cells[1]))   # status codes, and reasons in parentheses
        rows[cells[0]] = rows[same.group(1)] if same else frozenset(named & STATUS_NAMES)
    common = rows.pop(EVERY_CALL, frozenset())
    return {name: codes | common | {"OK"} for name, codes in rows.items()}


def daemon_pid(sock: str) -> int:
    """The pid of the process serving ``sock`` (SO_PEERCRED), whoever started it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock)
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (our own child, dead but not yet reaped) is no daemon
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Report:
    seed: int
    requests: int = 0
    seconds: float = 0.0
    crashed: bool = False
    hangs: list[Outcome] = field(default_factory=list)
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    by_method: dict[str, collections.Counter[str]] = field(default_factory=dict)
    undocumented: set[tuple[str, str]] = field(default_factory=set)
    rss_before: int = 0
    rss_after: int = 0

    @property
    def ok(self) -> bool:
        return not self.crashed and not self.hangs and not self.undocumented

    def add(self, outcome: Outcome, documented: dict[str, frozenset[str]]) -> None:
        self.requests += 1
        self.statuses[outcome.status] += 1
        self.by_method.setdefault(outcome.method, collections.Counter())[outcome.status] += 1
        if outcome.status == "HANG":
            self.hangs.append(outcome)
        elif outcome.status not in documented.get(outcome.method, frozenset({"OK"})):
            self.undocumented.add((outcome.method, outcome.status))

    def text(self) -> str:
        lines = [f"seed {self.seed}: {self.requests} requests in {self.seconds:.1f} s",
                 f"crashes: {int(self.crashed)}  hangs: {len(self.hangs)}  "
                 f"undocumented statuses: {sorted(self.undocumented) or 'none'}",
                 f"daemon RSS: {self.rss_before / 2**20:.1f} MiB before, {self.rss_after / 2**20:.1f} MiB after",
                 "statuses: " + ", ".join(f"{s} {n}" for s, n in self.statuses.most_common())]
        for name in sorted(self.by_method):
            lines.append(f"  {name:18} " + ", ".join(f"{s} {n}" for s, n in self.by_method[name].most_common()))
        for h in self.hangs[:10]:
            lines.append(f"hang: {h.method} ({h.kind})")
        return "\n".join(lines)


def victim(sock: str) -> tuple[kvstored.Client, Ids]:
    """A well-behaved client holding a session, a namespace, a lease and buffers: the ids a hostile
    client tries to use as its own."""
    client = kvstored.Client(sock)
    tokens = np.arange(64)
    client.save(tokens, np.ones((4, 512), np.uint8))
    namespace = client._ns(None)[0]
    session = client._session()
    found = client._stub.Lookup(pb.LookupRequest(namespace_id=namespace, session_id=session, lease=True,
                                                 keys=pb.BlockKeys(token_ids=tokens.tolist())), timeout=10)
    return client, Ids(namespace=namespace, victim_session=session, victim_leases=(found.lease_id,))


def run(sock: str, n: int, seed: int, timeout_s: float, documented: dict[str, frozenset[str]],
        between: Callable[[], None] | None = None, every: int = 200, transport: str = "grpc") -> Report:
    """Fire ``n`` hostile requests at the daemon on ``sock`` (by gRPC, or in frames on its fast
    socket, a fifth of them frames that are no requests), calling ``between`` (a health check)
    every ``every`` requests; stops early if the daemon dies."""
    report = Report(seed)
    pid = daemon_pid(sock)
    report.rss_before = rss_bytes(pid)
    rng = random.Random(seed)
    owner, ids = victim(sock)
    own = kvstored.Client(sock)
    ids = Ids(own._session(), ids.namespace, ids.victim_session, ids.victim_leases, ids.victim_buffers)
    requests = Requests(rng, ids)
    targets = methods(transport)
    fast_socket = own._hello.fast_socket
    if transport == "frames" and not fast_socket:
        raise RuntimeError(f"the daemon on {sock} offers no fast socket (server.fast_socket = false?)")
    documented = documented | {FRAME: FRAME_OUTCOMES}
    start = time.monotonic()
    try:
        with grpc.insecure_channel(f"unix:{sock}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            for i in range(n):
                kind = rng.choice(KINDS)
                if kind == "huge" and rng.random() < 0.9:   # the costliest to build and to send
                    kind = "random"
                if transport == "frames" and rng.random() < 0.2:
                    frame_kind = rng.choice(FRAME_KINDS)
                    report.add(fire_bad_frame(fast_socket, bad_frame(rng, frame_kind), frame_kind, timeout_s),
                               documented)
                elif transport == "frames":
                    report.add(fire_frames(fast_socket, requests.make(rng.choice(targets), kind), timeout_s),
                               documented)
                else:
                    report.add(fire(ch, requests.make(rng.choice(targets), kind), timeout_s), documented)
                if (i + 1) % every == 0 or i + 1 == n:
                    if not alive(pid):
                        report.crashed = True
                        break
                    if between is not None:
                        between()
    finally:
        own.close()
        owner.close()
    report.seconds = time.monotonic() - start
    if alive(pid):
        report.rss_after = rss_bytes(pid)
    else:
        report.crashed = True
    return report


def _start_daemon(tmp: Path) -> subprocess.Popen[bytes]:
    sock = tmp / "kv.sock"
    args = [sys.executable, "-m", "kvstored", "--no-config", "--socket", str(sock), "--dram-capacity", "64MiB",
            "--set", "dram.page_bytes=1MiB", "--set", f"dram.shm_dir={tmp}", "--ssd-path", str(tmp / "ssd"),
            "--ssd-capacity", "256MiB"]
    with open(tmp / "kv.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return proc
            except grpc.RpcError:
                time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"kvstored did not start:\n{(tmp / 'kv.log').read_text(errors='replace')}")


def stats_check(sock: str) -> Callable[[], None]:
    """A check that the daemon still answers a well-behaved client."""
    def check() -> None:
        with kvstored.Client(sock) as c:
            c.stats()
    return check


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests to fire (default 1000)")
    parser.add_argument("--socket", help="fuzz the daemon on this socket (default: start one)")
    parser.add_argument("--seed", type=int, help="seed of the random requests (default: from the clock)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="a call unanswered this long is a hang")
    parser.add_argument("--transport", choices=TRANSPORTS, default="grpc",
                        help="gRPC (every method), or frames on the daemon's fast socket (the methods it carries)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else time.time_ns() % (1 << 32)
    print(f"seed {seed}", flush=True)
    documented = documented_statuses((ROOT / "README.md").read_text())
    proc: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="kvstored-fuzz-") as tmp:
        sock = args.socket
        if sock is None:
            proc = _start_daemon(Path(tmp))
            sock = str(Path(tmp) / "kv.sock")
        try:
            report = run(sock, args.requests, seed, args.timeout_s, documented, stats_check(sock),
                         transport=args.transport)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        print(report.text())
        if proc is not None:
            log = (Path(tmp) / "kv.log").read_text(errors="replace")
            print(f"daemon log: {len(log)} bytes, {log.count('Traceback')} tracebacks, "
                  f"{log.count('bad request from')} bad-request lines; exit status {proc.returncode}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
