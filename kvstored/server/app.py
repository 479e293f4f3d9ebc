"""The daemon process: parse flags, open the tiers, serve gRPC, shut down cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
import lmdb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstored import config as config_mod
from kvstored.cluster.membership import MembershipError
from kvstored.config import Config, ConfigError
from kvstored.copy import CopyEngine
from kvstored.peers.errors import PeerConfigError
from kvstored.peers.node import PeerNode
from kvstored.presence import PresenceTable, planned_buckets
from kvstored.rpc_guard import BadRequests, RequestGuard
from kvstored.server import gc_freeze, logs, sdnotify
from kvstored.server.fast_path import FastPath
from kvstored.server.kv_events import KvEvents
from kvstored.server.metrics import RpcTimer, Snapshot, serve_metrics
from kvstored.server.servicer import KVStoreServicer
from kvstored.server.startup import StartupProgress, StartupStopped
from kvstored.server.status import abort
from kvstored.store import BlockStore
from kvstored.tiers.dram import Arena, ArenaTooLarge, sweep_stale_arenas
from kvstored.tiers.ssd import InUse, SSDTier
from kvstored_client import __version__
from kvstored_client.contract.frames import fast_socket_path
from kvstored_client.contract.presence import MAX_ARENA_BYTES, file_bytes, presence_table_path
from kvstored_client.contract.proto import kvstored_pb2_grpc as pb_grpc

log = logging.getLogger("kvstored")
SERVICE_NAME = "kvstored.v1.KVStore"
MAX_MESSAGE_BYTES = 64 << 20


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="kvstored", description="KV-cache storage daemon for LLM inference.")
    parser.add_argument("--config", help="TOML config file (default: /etc/kvstored/kvstored.toml if present)")
    parser.add_argument("--no-config", action="store_true",
                        help="embedded defaults and flags only: read no config file, not even the system one")
    parser.add_argument("--socket", help="Unix socket path (server.socket)")
    parser.add_argument("--tcp", help="additional TCP listener host:port (server.tcp)")
    parser.add_argument("--dram-capacity", help="DRAM arena size, e.g. 4GiB (dram.capacity)")
    parser.add_argument("--ssd-path", help="directory of the SSD tier: slot files and LMDB index (ssd.path)")
    parser.add_argument("--ssd-capacity", help="SSD tier size, e.g. 100GiB (ssd.capacity)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log.level")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key (repeatable)")
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    parser.add_argument("--version", action="version", version=f"kvstored {__version__}")
    args = parser.parse_args(argv)
    if args.no_config and args.config:
        parser.error("--config and --no-config exclude each other")
    overrides = list(args.set)
    for flag, key in (("socket", "server.socket"), ("tcp", "server.tcp"),
                      ("dram_capacity", "dram.capacity"), ("ssd_path", "ssd.path"),
                      ("ssd_capacity", "ssd.capacity"), ("log_level", "log.level")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = config_mod.load(args.config, overrides, system=not args.no_config)
    except ConfigError as exc:
        print(f"kvstored: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(_effective_json(cfg))
        return 0
    logs.configure(cfg.log.level, sys.stderr)
    import uvloop

    try:
        return uvloop.run(serve(cfg))
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    except StartupStopped as exc:
        log.info("%s", exc)
        return 0


def _effective_json(cfg: Config) -> str:
    """The config as the daemon will run it: defaults resolved (socket, SSD path), the socket
    mode in octal as it is written in the config file."""
    import dataclasses
    import json

    data = dataclasses.asdict(cfg)
    data["server"]["socket"] = cfg.socket_path
    data["server"]["socket_mode"] = f"{cfg.server.socket_mode:04o}"
    data["ssd"]["path"] = cfg.ssd_path
    if cfg.peers.token:   # a secret: say that one is set, not what it is
        data["peers"]["token"] = "<set, not shown>"
    return json.dumps(data, indent=2)


def _metrics_snapshot(store: BlockStore, peers: PeerNode | None, events: KvEvents | None) -> Snapshot:
    return Snapshot(store.stats(), peers.pushed if peers is not None else 0,
                    peers.failures if peers is not None else 0,
                    events.publisher.sent_events if events is not None else 0,
                    events.publisher.dropped_events if events is not None else 0)


def _stop_metrics(server: WSGIServer | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


class StartupError(Exception):
    """The daemon cannot start (socket in use, directory not ours, ...)."""


def _prepare_socket(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # the directory's owner, and the link's where it is one: anyone may plant a symlink in /tmp
        # (to a root-owned directory they can write, such as /tmp itself); the SDK refuses one too
        owner = path.parent.stat().st_uid
        link_owner = path.parent.lstat().st_uid
    except FileExistsError:  # mkdir met a file where a directory should be
        raise StartupError(f"cannot create the directory of server.socket {path}: "
                           f"{path.parent} is not a directory") from None
    except OSError as exc:
        raise StartupError(f"cannot create the directory of server.socket {path}: "
                           f"{exc.strerror or exc}") from None
    if not path.parent.is_dir():
        raise StartupError(f"cannot create the directory of server.socket {path}: "
                           f"{path.parent} is not a directory")
    if owner not in (os.getuid(), 0) or link_owner not in (os.getuid(), 0):
        raise StartupError(f"{path.parent} belongs to another user; choose another server.socket")
    if path.exists() or path.is_symlink():
        # Only a socket may be taken for one a dead daemon left: a file of any other kind at
        # this path (a mistyped --socket naming a config or data file) is the user's, not ours.
        try:
            is_socket = stat.S_ISSOCK(path.lstat().st_mode)
        except FileNotFoundError:
            return   # it went away meanwhile
        except OSError as exc:
            raise StartupError(f"cannot inspect server.socket {path}: {exc.strerror or exc}") from None
        if not is_socket:
            raise StartupError(f"server.socket {path} exists and is not a socket; remove it or choose "
                               "another server.socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                try:
                    path.unlink()  # stale: left by a daemon that died
                except OSError as exc:
                    raise StartupError(f"cannot replace the stale server.socket {path}: "
                                       f"{exc.strerror or exc}") from None
            else:
                raise StartupError(f"another kvstored is already listening on {path}")


def _file_id(path: Path) -> tuple[int, int, int] | None:
    """Which file ``path`` is: an inode number freed by an unlink is often the next one given
    out (ext4), so the change time tells a successor's socket from ours."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _pin_for_cuda(arena: Arena, starting: StartupProgress) -> bool:
    """Page-lock the arena when cupy and a GPU are present; the daemon runs fine without either."""
    try:
        from kvstored import cuda
    except ImportError:
        return False
    starting.step("pinning the DRAM arena for CUDA copies (when a GPU is present)", expect_s=arena.capacity / 1e9)
    return cuda.pin_host(arena)


async def serve(cfg: Config) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    shutting_down = asyncio.Event()
    starting = StartupProgress()
    # Until it serves, the daemon runs long steps without yielding to the loop (pre-faulting the
    # arena, restoring the SSD index): a plain handler marks the stop, and the start ends at its
    # next report (cleaning up as any failed start does) instead of after the restore.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: starting.request_stop())

    sock_path = Path(cfg.socket_path)
    _prepare_socket(sock_path)
    fast_path_file = Path(fast_socket_path(str(sock_path))) if cfg.server.fast_socket else None
    if fast_path_file is not None:
        _prepare_socket(fast_path_file)   # (a stale one a dead daemon left is taken over)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

    # No SO_REUSEPORT (gRPC's default): a second daemon on the same TCP port must fail to start,
    # not share the port and answer every other call.
    timer = RpcTimer() if cfg.server.metrics else None
    bad_requests = BadRequests()
    # the guard outermost: a request that does not parse is refused before any other sees it
    interceptors: list[grpc.aio.ServerInterceptor] = [RequestGuard(bad_requests, abort)]
    if timer is not None:
        interceptors.append(timer)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)],
                             interceptors=interceptors)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    arena: Arena | None = None
    ssd: SSDTier | None = None
    copy: CopyEngine | None = None
    peers: PeerNode | None = None
    events: KvEvents | None = None
    metrics_server: WSGIServer | None = None
    fast: FastPath | None = None
    fast_id: tuple[int, int, int] | None = None
    presence: PresenceTable | None = None
    socket_bound = False
    tcp_address = ""
    try:
        old_umask = os.umask(0o777 & ~cfg.server.socket_mode)
        try:
            try:
                server.add_insecure_port(f"unix:{sock_path}")
            except RuntimeError:  # grpc logs the reason (path too long, ...)
                raise StartupError(f"cannot listen on server.socket {sock_path}") from None
            socket_bound = True
            if cfg.server.tcp:
                try:
                    bound = server.add_insecure_port(cfg.server.tcp)
                except RuntimeError:
                    bound = 0
                if bound == 0:
                    raise StartupError(f"cannot listen on server.tcp {cfg.server.tcp}")
                # the port bound, which port 0 (any free port) leaves to the kernel to choose
                tcp_address = f"{cfg.server.tcp.rpartition(':')[0]}:{bound}"
        finally:
            os.umask(old_umask)

        if stale := sweep_stale_arenas(cfg.dram.shm_dir):
            log.info("removed %d arena file(s) left by daemons that died: %s", len(stale), ", ".join(stale))
        # pre-faulting runs at several GB/s here: 1 GB/s leaves room for a slower host
        starting.step(f"opening the DRAM tier: {cfg.dram.capacity >> 20} MiB arena in {cfg.dram.shm_dir}",
                      expect_s=cfg.dram.capacity / 1e9 if cfg.dram.prefault else 0.0)
        try:
            arena = Arena(cfg.dram.shm_dir, cfg.dram.capacity, cfg.server.socket_mode, cfg.dram.prefault,
                          progress=lambda done, total: starting.advance(done >> 20, total >> 20))
        except ArenaTooLarge as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:
            raise StartupError(f"cannot create the DRAM arena in {cfg.dram.shm_dir}: {exc}") from None
        huge = arena.huge_page_bytes()
        if huge is not None and cfg.dram.prefault:
            if huge >= arena.capacity // 2:
                log.info("DRAM arena on huge pages (%d of %d MiB)", huge >> 20, arena.capacity >> 20)
            else:
                log.info("DRAM arena on 4 KiB pages (%d of %d MiB on huge pages): copies in and out of it run "
                         "faster from a tmpfs mounted with huge=within_size as dram.shm_dir (README, Huge pages)",
                         huge >> 20, arena.capacity >> 20)
        if cfg.ssd.enabled:
            starting.step(f"opening the SSD tier: {cfg.ssd.capacity >> 20} MiB in {cfg.ssd_path}")
            try:
                ssd = SSDTier(cfg.ssd_path, int(cfg.ssd.capacity * cfg.ssd.map_slack), cfg.ssd.read_threads,
                              cfg.ssd.sync, progress=starting.report, disk_budget=cfg.ssd.disk_budget)
            except InUse as exc:
                raise StartupError(str(exc)) from None
            except lmdb.MemoryError as exc:   # mmap of the index refused: more than the address space
                map_tib = cfg.ssd.capacity * cfg.ssd.map_slack / (1 << 40)
                raise StartupError(f"cannot open the SSD tier in {cfg.ssd_path}: {exc}: its LMDB index is mapped at "
                                   f"ssd.capacity x ssd.map_slack = {map_tib:,.1f} TiB of address space (a process has "
                                   "128 TiB on x86-64): lower ssd.capacity or ssd.map_slack") from None
            except (OSError, lmdb.Error) as exc:
                raise StartupError(f"cannot open the SSD tier in {cfg.ssd_path}: {exc}") from None
        if _pin_for_cuda(arena, starting):
            log.info("DRAM arena pinned for CUDA copies (cudaHostRegister)")
        copy = CopyEngine(arena)
        if fast_path_file is not None and cfg.server.presence_table and cfg.dram.capacity > MAX_ARENA_BYTES:
            log.warning("no presence table: its where words name arenas of up to %d TiB", MAX_ARENA_BYTES >> 40)
        elif fast_path_file is not None and cfg.server.presence_table:
            # before the restore: its blocks enter the table as they enter the index
            buckets = cfg.server.presence_buckets or planned_buckets(
                cfg.dram.capacity, cfg.ssd.capacity if cfg.ssd.enabled else 0)
            try:
                presence = PresenceTable(Path(presence_table_path(str(sock_path))), buckets, cfg.server.socket_mode)
            except OSError as exc:   # the SDK's lookups then take the call: slower, not wrong
                log.warning("no presence table (%d buckets, %d MiB) next to %s: %s; SDK lookups take the "
                            "call (server.presence_buckets sizes it)", buckets, file_bytes(buckets) >> 20,
                            sock_path, exc.strerror or exc)
        store = BlockStore(cfg, arena, copy, ssd, presence=presence)
        if cfg.events.enabled:   # before the restore: its blocks are announced as they come back
            try:
                events = KvEvents(cfg, store, loop)
            except OSError as exc:
                raise StartupError(f"cannot publish KV events: {exc}") from None
            events.start()
            log.info("KV events on %s (replay %s), node %s, epoch %d", events.publisher.endpoint,
                     events.publisher.replay_endpoint or "off", events.publisher.node_id, events.publisher.epoch)
        try:
            report = store.restore(starting.report)
        except (OSError, lmdb.Error) as exc:   # a damaged index, a failing disk: not ours to repair
            raise StartupError(f"cannot restore the SSD tier's index in {cfg.ssd_path}: {exc} (move "
                               "the directory aside to start with an empty tier)") from None
        if report.blocks or report.dropped:
            log.info("restored %d block(s) in %d namespace(s) from SSD; dropped %d unusable record(s)",
                     report.blocks, report.namespaces, report.dropped)
        if report.evicted:
            log.info("evicted %d restored block(s) to fit ssd.capacity (%d MiB)", report.evicted,
                     cfg.ssd.capacity >> 20)
        if cfg.peers.listen or cfg.peers.static or cfg.peers.etcd:
            starting.step("joining the cluster")
            try:
                peers = PeerNode(cfg, store, bad_requests=bad_requests)
                await peers.start()
            except (ConfigError, PeerConfigError, MembershipError, OSError, ValueError) as exc:
                starting.check()   # asked to stop while joining: a stop, not a failed start
                raise StartupError(f"cannot join the cluster: {exc}") from None
            log.info("peers: node %s, block channel on %s, membership %s, %d peer(s) known", peers.node_id,
                     peers.listen or "(not listening)", peers.membership_name, len(peers.known_peers))
        servicer = KVStoreServicer(store, arena, cfg.leases.ttl_s, cfg.server.max_batch_blocks, shutting_down,
                                   peers, fast_socket=str(fast_path_file or ""))
        pb_grpc.add_KVStoreServicer_to_server(servicer, server)
        if fast_path_file is not None:
            # before gRPC serves: a Hello never names a socket nobody listens on
            fast = FastPath(servicer, bad_requests,
                            (lambda name: timer.histogram.labels(name).observe) if timer is not None else None)
            try:
                await fast.start(fast_path_file, cfg.server.socket_mode)
            except OSError as exc:
                raise StartupError(f"cannot listen on the fast socket {fast_path_file}: {exc.strerror or exc} "
                                   "(server.fast_socket = false turns it off)") from None
            fast_id = _file_id(fast_path_file)
        if cfg.server.metrics:
            snapshot = functools.partial(_metrics_snapshot, store, peers, events)
            try:
                metrics_server = serve_metrics(cfg.server.metrics, asyncio.get_running_loop(), snapshot, timer,
                                               [bad_requests.counter])
            except (OSError, ValueError) as exc:
                raise StartupError(f"cannot serve server.metrics on {cfg.server.metrics}: {exc}") from None
            port = metrics_server.server_address[1]
            log.info("Prometheus metrics on http://%s:%s/metrics", cfg.server.metrics.rpartition(":")[0], port)
        starting.step("starting the gRPC server")
        await server.start()
        os.chmod(sock_path, cfg.server.socket_mode)
        sock_id = _file_id(sock_path)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if starting.stop_requested:   # came during the last await of the start
            stop.set()
    except BaseException:
        # Whatever stopped the start-up, leave no arena in the shm dir and no socket nobody serves.
        _stop_metrics(metrics_server)
        with contextlib.suppress(Exception):
            await server.stop(None)
        if fast is not None:
            fast.close()
            if fast_path_file is not None and _file_id(fast_path_file) == fast_id:
                with contextlib.suppress(OSError):
                    fast_path_file.unlink()
        if peers is not None:
            with contextlib.suppress(Exception):
                await peers.close()
        if events is not None:
            events.close()
        if copy is not None:
            copy.close()
        if ssd is not None:
            ssd.close()
        if arena is not None:
            arena.close()
        if presence is not None:
            presence.close()
        if socket_bound:
            with contextlib.suppress(OSError):
                sock_path.unlink()
        raise

    async def reaper() -> None:
        while True:
            await asyncio.sleep(cfg.leases.reap_interval_s)
            if n := store.reap():
                log.info("expired %d lease(s)", n)

    async def watchdog(interval: float) -> None:
        while True:
            sdnotify.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def reader_check(interval: float) -> None:
        assert ssd is not None
        while True:
            await asyncio.sleep(interval)
            if n := ssd.reader_check():
                log.info("cleared %d stale LMDB reader slot(s)", n)

    tasks = [asyncio.ensure_future(reaper())]
    if events is not None:
        tasks.append(asyncio.ensure_future(events.report_loop()))
    if cfg.server.gc_freeze_interval_s:
        # the restored index first: its blocks are the bulk of the heap from the start
        log.debug("garbage collection and freeze after start-up: %.1f ms", gc_freeze.freeze() * 1e3)
        tasks.append(asyncio.ensure_future(gc_freeze.freeze_loop(cfg.server.gc_freeze_interval_s)))
    if ssd is not None:
        tasks.append(asyncio.ensure_future(store.writeback_loop()))
        tasks.append(asyncio.ensure_future(reader_check(cfg.ssd.reader_check_interval_s)))
    interval = sdnotify.watchdog_interval_s()
    if interval and cfg.server.watchdog:
        tasks.append(asyncio.ensure_future(watchdog(interval)))
    elif interval:
        log.warning("systemd expects a watchdog ping every %.0f s (WatchdogSec=) but server.watchdog = false: "
                    "it will stop this daemon; remove WatchdogSec= from the unit or set server.watchdog = true",
                    2 * interval)

    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    serving = f"{sock_path}" + (f" and {tcp_address}" if tcp_address else "")
    sdnotify.notify(f"READY=1\nSTATUS=serving on {serving}\nMAINPID={os.getpid()}")
    if fast is not None:
        log.info("fast path (the hot calls in frames) on unix:%s", fast_path_file)
    log.info("kvstored %s serving on unix:%s%s", __version__, sock_path,
             f" and {tcp_address}" if tcp_address else "")

    await stop.wait()
    log.info("shutting down: finishing in-flight calls")
    # in-flight calls, then the write-back, each up to server.shutdown_grace_s: a TimeoutStopSec=
    # shorter than that would SIGKILL the write-back and lose blocks only DRAM held
    sdnotify.notify("STOPPING=1\nSTATUS=stopping: finishing in-flight calls, then writing DRAM-only blocks to SSD\n"
                    f"EXTEND_TIMEOUT_USEC={int((2 * cfg.server.shutdown_grace_s + 10) * 1e6)}")
    await health_servicer.enter_graceful_shutdown()
    if metrics_server is not None:   # its scrapes ask this loop, which is about to end
        await asyncio.to_thread(_stop_metrics, metrics_server)
    # No new calls from here on; calls with a copy in flight finish under their sessions first
    # (ending a session dooms its busy leases: a SaveBlocks copying at SIGTERM stored nothing).
    stopping = asyncio.ensure_future(server.stop(cfg.server.shutdown_grace_s))
    if fast is not None:
        fast.stop_accepting()   # calls still coming on open connections are answered DAEMON_STOPPING
    if not await store.quiesce(cfg.server.shutdown_grace_s):
        log.warning("copies still in flight after %.0f s (server.shutdown_grace_s): ending their sessions",
                    cfg.server.shutdown_grace_s)
    shutting_down.set()  # ends session streams so clients see the shutdown
    await stopping
    if fast is not None:
        fast.close()
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if peers is not None:
        await peers.close()
    if ssd is not None and cfg.ssd.admission != "never":
        # Blocks only in DRAM die with the arena: write them down (bounded, so that the stop
        # stays within systemd's TimeoutStopSec=) and say what could not be.
        budget = max(cfg.server.shutdown_grace_s, 1.0)
        written = 0
        try:
            written = await asyncio.wait_for(store.write_back_for_shutdown(), budget)
        except TimeoutError:
            log.warning("write-back at shutdown stopped after %.0f s (server.shutdown_grace_s)", budget)
        except Exception:
            log.exception("write-back at shutdown failed")
        await store.finish_background()
        if written:
            log.info("wrote %d DRAM-only block(s) to SSD before stopping", written)
    if ssd is not None:
        try:   # bounded like the write-back: the records keep the counts of their last write
            updated = await asyncio.wait_for(store.record_reuses(), max(cfg.server.shutdown_grace_s, 1.0))
            log.info("kept the reuse counts of %d block(s) and what the policies learned with the SSD tier", updated)
        except TimeoutError:
            log.warning("recording reuse counts at shutdown stopped after %.0f s (server.shutdown_grace_s)",
                        max(cfg.server.shutdown_grace_s, 1.0))
        except Exception:
            log.exception("recording reuse counts at shutdown failed")
    await store.finish_background()
    if ssd is not None and (left := store.dram_only_blocks()):
        log.warning("%d block(s) only in DRAM are dropped (not on SSD: ssd.admission, a full SSD tier "
                    "or write errors)", left)
    if events is not None:
        events.close()
    copy.close()
    if ssd is not None:
        ssd.close()  # commits writes already queued
    arena.close()
    if presence is not None:
        presence.close()
    # Only our own socket: a daemon started on this path since our listener closed (it found a
    # stale socket and took the path) keeps its own.
    if _file_id(sock_path) == sock_id:
        with contextlib.suppress(FileNotFoundError):
            sock_path.unlink()
    if fast_path_file is not None and _file_id(fast_path_file) == fast_id:
        with contextlib.suppress(FileNotFoundError):
            fast_path_file.unlink()
    log.info("stopped")
    return 0
