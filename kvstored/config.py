"""Daemon configuration: TOML file + flag overrides -> a validated, frozen :class:`Config`.

Sources, later wins: embedded defaults, the TOML file (``--config``, else
``/etc/kvstored/kvstored.toml`` when it exists), then ``--set section.key=value`` flags.
Unknown sections or keys and bad values raise :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstored.addresses import is_loopback
from kvstored.policy.registry import DEFAULT_POLICY, POLICIES
from kvstored_client.contract.paths import default_socket_path, socket_path_problem

SYSTEM_CONFIG = Path("/etc/kvstored/kvstored.toml")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket: str = ""                 # Unix socket path; "" = default runtime location
    socket_mode: int = 0o660
    tcp: str = ""                    # "host:port" for an additional TCP listener; "" = none
    metrics: str = ""                # "host:port" serving Prometheus metrics at /metrics; "" = none
    insecure: bool = False           # allow an unauthenticated TCP listener on a non-loopback address
    max_batch_blocks: int = 16384    # blocks in one request (a 256k-token prompt at 16/block)
    shutdown_grace_s: float = 10.0
    watchdog: bool = True            # send WATCHDOG=1 when systemd asks for it
    gc_freeze_interval_s: float = 60.0   # collect, then freeze long-lived objects (0 = leave the GC as it is)
    fast_socket: bool = True         # also serve the hot calls in frames on a second Unix socket (the fast path)
    presence_table: bool = True      # publish the readable blocks in a shared-memory file (SDK lookups without a call)
    presence_buckets: int = 0        # its size: buckets of 8 blocks (a power of two); 0 = planned from the capacities


@dataclass(frozen=True, slots=True)
class DramConfig:
    capacity: int = 1 << 30          # bytes of the shared-memory arena
    page_bytes: int = 32 << 20       # arena pages; one page holds blocks of one size
    shm_dir: str = "/dev/shm"
    prefault: bool = True
    # Keep blocks without a slower-tier copy under this share of the arena, so that eviction
    # usually finds a clean block it can drop at once.
    writeback_watermark: float = 0.75
    policy: str = DEFAULT_POLICY     # eviction order of the arena (per slot size): see POLICIES
    # A save that finds DRAM full of blocks not yet on SSD (which may not leave uncopied) waits up
    # to this long for the write-back to copy some, then stores what fits.
    room_wait_s: float = 5.0
    # DRAM each session may hold in spare slots, bound to no block, that its saves copy rows into
    # before naming the blocks: a save in one call (at most 1/16 of the arena, all sessions
    # together at most 1/8; 0: none).
    spare_bytes: int = 256 << 20
    # The slots a client may still be copying rows into stay out of use this long before they are
    # free: an ended session's spare slots, and those of a reservation its session ended under or
    # that expired (the client learns of the end after the daemon).
    quarantine_s: float = 30.0


@dataclass(frozen=True, slots=True)
class SSDConfig:
    enabled: bool = True
    path: str = ""                   # "" = the state directory (see default_state_dir) + /ssd
    capacity: int = 8 << 30          # payload bytes kept on disk
    map_slack: float = 1.5           # LMDB index map = capacity x this (sparse; never the limit)
    high_watermark: float = 0.95     # above this share of capacity, evict ...
    low_watermark: float = 0.85      # ... down to this share
    admission: str = "always"        # demote from DRAM: always | never | hit_before | cost
    policy: str = DEFAULT_POLICY     # eviction order and admission of the SSD tier: see POLICIES
    read_threads: int = 2
    sync: bool = True                # fsync each group commit (off: faster, loses recent writes on power loss)
    # Blocks sealed longer ago than this are on SSD (when ssd.admission accepts them): a kill -9
    # loses at most the blocks of this window (and of the write in flight).
    max_dirty_s: float = 1.0
    reader_check_interval_s: float = 30.0

    @property
    def disk_budget(self) -> int:
        """Payload bytes the SSD tier's slot files may hold disk space for before free slots
        are punched out: the capacity plus the gap between the watermarks, since a write-back
        round takes fresh slots for up to that gap before its evictions' deletes free theirs
        (within it, steady churn never punches a slot it is about to write again)."""
        return int(self.capacity * (1 + self.high_watermark - self.low_watermark))


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    ttl_s: float = 30.0              # a read lease expires after this
    reservation_ttl_s: float = 60.0  # an unsealed reservation is dropped after this
    reap_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class KeysConfig:
    allow_fast_hash: bool = False    # admit xxh3_128 namespaces (trusted single-tenant nodes)


@dataclass(frozen=True, slots=True)
class PeersConfig:
    listen: str = ""                 # "host:port" of the peer block channel; "" = peers off
    advertise: str = ""              # address peers dial; "" = listen (must then be a concrete host)
    node_id: str = ""                # "" = the host name
    token_file: str = ""             # shared token (first non-empty line of the file); preferred over token
    token: str = ""                  # shared token inline (visible in the config: use token_file)
    tls_ca: str = ""                 # mutual TLS: CA that signs every node's certificate
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False           # allow an unauthenticated listener on a non-loopback address
    static: tuple[str, ...] = ()     # fixed peers, "node_id=host:port" each (no etcd needed)
    etcd: str = ""                   # etcd client endpoint "host:port" for membership; "" = off
    etcd_ttl_s: int = 10             # a dead node leaves the cluster after about this long
    deadline_s: float = 30.0         # one transfer (fetch or push) ends by then, short if need be
    lookup_timeout_s: float = 1.0    # asking peers what they hold


@dataclass(frozen=True, slots=True)
class EventsConfig:
    enabled: bool = False            # publish KV events (vLLM's format) over ZMQ
    endpoint: str = "tcp://127.0.0.1:5557"          # PUB socket the daemon binds (tcp:// or ipc://)
    replay_endpoint: str = "tcp://127.0.0.1:5558"   # ROUTER socket: replay from a seq, snapshots; "" = none
    topic: str = "kv@{node}@{model}"                # per namespace's model (llm-d's form)
    heartbeat_topic: str = "kvstored-heartbeat@{node}"
    hash_format: str = "int64"       # int64 (a key's last 8 bytes, as vLLM sends by default) | bytes
    buffer_steps: int = 10000        # batches kept for replay
    hwm: int = 100000                # PUB high-water mark: messages queued per subscriber
    queue_batches: int = 10000       # batches waiting for the sender thread; past it they are dropped
    heartbeat_s: float = 1.0
    node_id: str = ""                # "" = peers.node_id, else the host name
    insecure: bool = False           # allow a non-loopback tcp:// endpoint (events name every cached prefix)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router process's section (``kvstored-router`` reads the same file; the daemon ignores it)."""

    listen: str = "127.0.0.1:8300"   # HTTP API (POST /v1/route, /v1/report; GET /v1/nodes)
    grpc: str = ""                   # gRPC: kvstored.v1.Router and llm-d's indexer.v1.IndexerService; "" = off
    sources: tuple[str, ...] = ()    # daemons' events: "node=PUB_ENDPOINT[,REPLAY_ENDPOINT]" each
    engines: tuple[str, ...] = ()    # vLLM engines' own events (the GPU tier), the same form
    engine_model: str = "default"    # the namespace of the engines' events: its model ...
    engine_block_size: int = 16      # ... and tokens per block (other fields at their defaults)
    heartbeat_timeout_s: float = 3.0   # a daemon silent this long is dropped from the index
    etcd: str = ""                   # membership: a node whose lease expires is dropped; "" = peers.etcd
    prefill_flops_per_s: float = 4.0e14   # prefill speed until engines report measured prefills
    decode_s: float = 0.02           # decode time of a first block
    peer_bytes_per_s: float = 5.0e9  # the peer link, for "route to X, let X pull from Y"
    spread: float = 0.05             # candidates within this share of the best TTFT are near-equal
    insecure: bool = False           # allow a non-loopback listen / grpc address (the API has no auth)


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "info"


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    ssd: SSDConfig = field(default_factory=SSDConfig)
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    keys: KeysConfig = field(default_factory=KeysConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def socket_path(self) -> str:
        return self.server.socket or default_socket_path()

    @property
    def ssd_path(self) -> str:
        return self.ssd.path or str(default_state_dir() / "ssd")


def default_state_dir() -> Path:
    """``$STATE_DIRECTORY`` (set by systemd's StateDirectory=), else ``$XDG_STATE_HOME/kvstored``,
    else ``~/.local/state/kvstored``."""
    if env := os.environ.get("STATE_DIRECTORY"):
        return Path(env.split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvstored"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_KEYS = {("dram", "capacity"), ("dram", "page_bytes"), ("dram", "spare_bytes"), ("ssd", "capacity")}
_MODE_KEYS = {("server", "socket_mode")}
_LOG_LEVELS = ("debug", "info", "warning", "error")
ADMISSION_MODES = ("always", "never", "hit_before", "cost")


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '4096' or an int -> bytes; ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"expected a size like '1GiB', got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


MAX_BATCH_BLOCKS = 1 << 22      # more block hashes (16 bytes and up each) than one 64 MiB message holds
MAX_READ_THREADS = 1024
MAX_MAP_BYTES = 1 << 63         # an LMDB map size is a size_t, and Python's int would overflow it
# Lease times travel to clients in milliseconds as uint32s (HelloResponse.lease_ttl_ms, ...): a
# longer one would fail every Hello or Reserve.
MAX_LEASE_TTL_S = ((1 << 32) - 1) // 1000
_HOSTPORT = re.compile(r"^[\w.\-\[\]:]+:(\d+)$")


def _as_int(value: Any) -> int:
    """An int from TOML (int, or a float with an integral value) or from a flag (decimal text)."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        return _as_int(number)
    raise ValueError(f"expected an integer, got {value!r}")


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _port_ok(address: str, *, zero: bool = False) -> bool:
    """``address`` is host:port with a port in 1..65535 (0 too when ``zero``: any free port)."""
    m = _HOSTPORT.match(address)
    return m is not None and (0 if zero else 1) <= int(m.group(1)) <= 65535


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    name = f"{section}.{key}"
    try:
        if (section, key) in _SIZE_KEYS:
            return parse_size(value)
        if (section, key) in _MODE_KEYS:
            return int(value, 8) if isinstance(value, str) else _as_int(value)
        if isinstance(default, tuple):
            if isinstance(value, str):   # from --set: comma-separated
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"expected a list of strings, got {value!r}")
            return tuple(value)
        if isinstance(default, bool):
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            return value
        if isinstance(default, int):
            return _as_int(value)
        if isinstance(default, float):
            return _as_float(value)
        if isinstance(default, str):
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            return value
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{name}: {exc}") from None
    raise AssertionError(f"no coercion for {name}")


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first invalid key of ``cfg``."""
    checks: list[tuple[bool, str]] = [
        (cfg.dram.capacity > 0, "dram.capacity: must be positive"),
        (cfg.dram.page_bytes >= 4096 and cfg.dram.page_bytes % 4096 == 0,
         "dram.page_bytes: must be a positive multiple of 4096"),
        (cfg.dram.capacity >= cfg.dram.page_bytes,
         "dram.capacity: must hold at least one page (dram.page_bytes)"),
        (cfg.server.presence_buckets >= 0 and cfg.server.presence_buckets & (cfg.server.presence_buckets - 1) == 0,
         "server.presence_buckets: must be 0 (planned) or a power of two"),
        (0 < cfg.server.max_batch_blocks <= MAX_BATCH_BLOCKS,
         f"server.max_batch_blocks: must be in 1..{MAX_BATCH_BLOCKS}"),
        (cfg.server.shutdown_grace_s >= 0, "server.shutdown_grace_s: must not be negative"),
        (cfg.server.gc_freeze_interval_s >= 0, "server.gc_freeze_interval_s: must not be negative (0: off)"),
        (cfg.dram.shm_dir.strip() != "", "dram.shm_dir: must name a directory (e.g. /dev/shm)"),
        (not socket_path_problem(cfg.socket_path), f"server.socket: {socket_path_problem(cfg.socket_path)}"),
        (0 <= cfg.server.socket_mode <= 0o777, "server.socket_mode: must be a file mode like '0660'"),
        (cfg.server.socket_mode & 0o600 == 0o600,
         "server.socket_mode: the owner (the daemon's user) needs read and write, e.g. '0660'"),
        (0 < cfg.leases.ttl_s <= MAX_LEASE_TTL_S,
         f"leases.ttl_s: must be positive and at most {MAX_LEASE_TTL_S} (about 49 days)"),
        (0 < cfg.leases.reservation_ttl_s <= MAX_LEASE_TTL_S,
         f"leases.reservation_ttl_s: must be positive and at most {MAX_LEASE_TTL_S} (about 49 days)"),
        (cfg.leases.reap_interval_s > 0, "leases.reap_interval_s: must be positive"),
        (0 < cfg.dram.writeback_watermark <= 1, "dram.writeback_watermark: must be in (0, 1]"),
        (cfg.dram.room_wait_s >= 0, "dram.room_wait_s: must not be negative"),
        (cfg.dram.spare_bytes >= 0, "dram.spare_bytes: must not be negative"),
        (cfg.dram.quarantine_s >= 0, "dram.quarantine_s: must not be negative"),
        (cfg.ssd.max_dirty_s > 0, "ssd.max_dirty_s: must be positive"),
        (cfg.ssd.capacity > 0, "ssd.capacity: must be positive"),
        (cfg.ssd.map_slack >= 1.1, "ssd.map_slack: must be at least 1.1"),
        (cfg.ssd.capacity * cfg.ssd.map_slack < MAX_MAP_BYTES,
         "ssd.map_slack: ssd.capacity x ssd.map_slack (the size the LMDB index is mapped at) must be under 8 EiB"),
        (0 < cfg.ssd.low_watermark < cfg.ssd.high_watermark <= 1,
         "ssd.low_watermark: must be below ssd.high_watermark, both in (0, 1]"),
        (cfg.dram.policy in POLICIES, f"dram.policy: must be one of {', '.join(POLICIES)}"),
        (cfg.ssd.policy in POLICIES, f"ssd.policy: must be one of {', '.join(POLICIES)}"),
        (cfg.ssd.admission in ADMISSION_MODES,
         f"ssd.admission: must be one of {', '.join(ADMISSION_MODES)}"),
        (1 <= cfg.ssd.read_threads <= MAX_READ_THREADS, f"ssd.read_threads: must be in 1..{MAX_READ_THREADS}"),
        (cfg.ssd.reader_check_interval_s > 0, "ssd.reader_check_interval_s: must be positive"),
        (cfg.log.level in _LOG_LEVELS, f"log.level: must be one of {', '.join(_LOG_LEVELS)}"),
        (cfg.server.tcp == "" or _port_ok(cfg.server.tcp, zero=True),
         "server.tcp: expected host:port with a port in 0..65535"),
        (cfg.server.metrics == "" or _port_ok(cfg.server.metrics, zero=True),
         "server.metrics: expected host:port with a port in 0..65535"),
    ]
    p = cfg.peers
    checks += [
        (p.listen == "" or _port_ok(p.listen, zero=True), "peers.listen: expected host:port with a port in 0..65535"),
        (p.advertise == "" or _port_ok(p.advertise), "peers.advertise: expected host:port with a port in 1..65535"),
        (p.etcd == "" or _port_ok(p.etcd.split("://", 1)[-1].rstrip("/")),
         "peers.etcd: expected host:port with a port in 1..65535"),
        # the etcd client speaks plain gRPC: an https:// endpoint would fail with a connection error
        (p.etcd.partition("://")[0].lower() == "http" if "://" in p.etcd else True,
         f"peers.etcd: only a plain http:// endpoint (or host:port) is supported, not {p.etcd!r}: "
         "TLS to etcd is not implemented"),
        # membership comes from one of them; the other would be ignored without a word
        (not (p.etcd and p.static), "peers.static: give either peers.static or peers.etcd, not both"),
        (not p.etcd or bool(p.listen or p.advertise),
         "peers.etcd: this node needs peers.listen (or peers.advertise) to join"),
        ("/" not in p.node_id, "peers.node_id: must not contain '/'"),
        (p.etcd_ttl_s >= 1, "peers.etcd_ttl_s: must be at least 1"),
        (p.deadline_s > 0, "peers.deadline_s: must be positive"),
        (p.lookup_timeout_s > 0, "peers.lookup_timeout_s: must be positive"),
        (bool(p.tls_ca) == bool(p.tls_cert) == bool(p.tls_key),
         "peers.tls_ca: mutual TLS needs tls_ca, tls_cert and tls_key together"),
    ]
    if p.listen and not (p.token or p.token_file or p.tls_ca or p.insecure) \
            and not is_loopback(p.listen.rpartition(":")[0].strip("[]")):
        raise ConfigError(f"peers.listen: {p.listen} is not a loopback address and no peer authentication is "
                          "configured (peers.token_file or peers.tls_*); set peers.insecure = true to accept that "
                          "explicitly")
    if p.etcd and p.listen and not p.advertise and p.listen.rpartition(":")[0].strip("[]") in ("", "0.0.0.0", "::"):
        raise ConfigError(f"peers.advertise: peers.listen {p.listen} is a wildcard address that other nodes cannot "
                          "dial; set peers.advertise to this node's host:port for etcd")
    seen: set[str] = set()
    for entry in p.static:
        node, sep, addr = entry.partition("=")
        checks.append((bool(sep and node and "/" not in node and _port_ok(addr)),
                       f"peers.static: expected node_id=host:port with a port in 1..65535, got {entry!r}"))
        checks.append((node not in seen, f"peers.static: node id {node!r} is listed more than once"))
        seen.add(node)
    checks += _events_checks(cfg.events) + _router_checks(cfg.router)
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    host = cfg.server.tcp.rpartition(":")[0].strip("[]")
    if cfg.server.tcp and not cfg.server.insecure and not is_loopback(host):
        raise ConfigError(f"server.tcp: {cfg.server.tcp} is not a loopback address and the API has no "
                          "authentication yet; set server.insecure = true to accept that explicitly")


HASH_FORMATS = ("int64", "bytes")


def zmq_endpoint_ok(endpoint: str, insecure: bool) -> str:
    """Why ``endpoint`` cannot be bound as an events socket ("" when it can): ``ipc://PATH`` or
    ``tcp://HOST:PORT``, HOST loopback unless ``insecure``."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc") or not rest:
        return f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}"
    if scheme == "ipc":
        return ""
    if not _port_ok(rest.replace("*", "0.0.0.0"), zero=False):
        return f"expected tcp://HOST:PORT with a port in 1..65535, got {endpoint!r}"
    host = rest.rpartition(":")[0].strip("[]")
    if not insecure and (host == "*" or not is_loopback(host)):
        return (f"{endpoint} is not a loopback address and events name every cached prefix; "
                "set events.insecure = true to accept that explicitly")
    return ""


def _events_checks(e: EventsConfig) -> list[tuple[bool, str]]:
    checks = [
        (e.hash_format in HASH_FORMATS, f"events.hash_format: must be one of {', '.join(HASH_FORMATS)}"),
        (e.buffer_steps >= 1, "events.buffer_steps: must be at least 1"),
        (e.hwm >= 1, "events.hwm: must be at least 1"),
        (e.queue_batches >= 1, "events.queue_batches: must be at least 1"),
        (e.heartbeat_s > 0, "events.heartbeat_s: must be positive"),
        ("@" not in e.node_id and "/" not in e.node_id, "events.node_id: must not contain '@' or '/'"),
    ]
    if e.enabled:
        why = zmq_endpoint_ok(e.endpoint, e.insecure)
        checks.append((not why, f"events.endpoint: {why}"))
        why = zmq_endpoint_ok(e.replay_endpoint, e.insecure) if e.replay_endpoint else ""
        checks.append((not why, f"events.replay_endpoint: {why}"))
        checks.append((e.endpoint != e.replay_endpoint, "events.replay_endpoint: must differ from events.endpoint"))
    return checks


def parse_source(entry: str) -> tuple[str, str, str]:
    """``node=PUB[,REPLAY]`` -> (node, pub endpoint, replay endpoint or ""); ValueError naming
    what is wrong."""
    node, sep, rest = entry.partition("=")
    endpoints = [e.strip() for e in rest.split(",")]
    if not sep or not node or "/" in node or len(endpoints) > 2 or not endpoints[0]:
        raise ValueError(f"expected node=PUB_ENDPOINT[,REPLAY_ENDPOINT], got {entry!r}")
    for endpoint in endpoints:
        scheme, sep, addr = endpoint.partition("://")
        if scheme not in ("tcp", "ipc") or not sep or not addr:
            raise ValueError(f"expected tcp:// or ipc:// endpoints, got {endpoint!r} in {entry!r}")
    return node.strip(), endpoints[0], endpoints[1] if len(endpoints) > 1 else ""


def _router_checks(r: RouterConfig) -> list[tuple[bool, str]]:
    checks = [
        (r.heartbeat_timeout_s > 0, "router.heartbeat_timeout_s: must be positive"),
        (r.prefill_flops_per_s > 0, "router.prefill_flops_per_s: must be positive"),
        (r.decode_s >= 0, "router.decode_s: must not be negative"),
        (r.peer_bytes_per_s > 0, "router.peer_bytes_per_s: must be positive"),
        (0 <= r.spread <= 1, "router.spread: must be in 0..1"),
        (1 <= r.engine_block_size <= 4096, "router.engine_block_size: must be in 1..4096"),
        (bool(r.engine_model), "router.engine_model: must not be empty"),
        (_port_ok(r.listen, zero=True), "router.listen: expected host:port with a port in 0..65535"),
        (r.grpc == "" or _port_ok(r.grpc, zero=True), "router.grpc: expected host:port with a port in 0..65535"),
        (r.etcd == "" or _port_ok(r.etcd.split("://", 1)[-1].rstrip("/")),
         "router.etcd: expected host:port with a port in 1..65535"),
    ]
    for name in ("listen", "grpc"):
        address = getattr(r, name)
        host = address.rpartition(":")[0].strip("[]")
        checks.append((not address or r.insecure or is_loopback(host),
                       f"router.{name}: {address} is not a loopback address and the router's API has no "
                       "authentication; set router.insecure = true to accept that explicitly"))
    for key in ("sources", "engines"):
        nodes: list[str] = []
        for entry in getattr(r, key):
            try:
                nodes.append(parse_source(entry)[0])
            except ValueError as exc:
                checks.append((False, f"router.{key}: {exc}"))
        dup = sorted({n for n in nodes if nodes.count(n) > 1})
        checks.append((not dup, f"router.{key}: node(s) listed twice: {', '.join(dup)}"))
    return checks


def build(values: dict[str, Any]) -> Config:
    """Build a Config from nested ``{section: {key: value}}``; raises ConfigError."""
    sections: dict[str, Any] = {}
    defaults = Config()
    known = {f.name for f in dataclasses.fields(Config)}
    for section, table in values.items():
        if section not in known:
            raise ConfigError(f"{section}: unknown section (expected one of {', '.join(sorted(known))})")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a table")
        current = getattr(defaults, section)
        fields = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)}
        for key, value in table.items():
            if key not in fields:
                raise ConfigError(f"{section}.{key}: unknown key (expected one of {', '.join(sorted(fields))})")
            fields[key] = _coerce(section, key, value, fields[key])
        sections[section] = type(current)(**fields)
    cfg = dataclasses.replace(defaults, **sections)
    validate(cfg)
    return cfg


def parse_override(text: str) -> tuple[str, str, str]:
    """'section.key=value' -> (section, key, value); ConfigError when malformed."""
    name, sep, value = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"{text}: expected section.key=value")
    return section, key, value.strip()


def load(path: str | None = None, overrides: list[str] | None = None, system: bool = True) -> Config:
    """Read the config file (explicit path, else the system one if present and ``system``) and
    apply overrides.

    Raises ConfigError for a missing explicit file, TOML syntax errors, unknown keys, bad values.
    """
    values: dict[str, dict[str, Any]] = {}
    file = Path(path) if path else (SYSTEM_CONFIG if system and SYSTEM_CONFIG.exists() else None)
    if file is not None:
        try:
            with open(file, "rb") as fh:
                values = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"{file}: config file not found") from None
        except IsADirectoryError:
            raise ConfigError(f"{file}: is a directory, not a config file") from None
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read the config file: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: {exc}") from None
    for text in overrides or []:
        section, key, value = parse_override(text)
        table = values.setdefault(section, {})
        if not isinstance(table, dict):   # the file set the section's name to a value, not a table
            raise ConfigError(f"{section}: expected a table")
        table[key] = value
    return build(values)
