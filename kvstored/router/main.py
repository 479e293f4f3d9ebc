"""``kvstored-router``: the router process (``[router]`` of the daemons' TOML file)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys

from kvstored import config as config_mod
from kvstored.config import Config, ConfigError
from kvstored.router.service import RouterService

log = logging.getLogger("kvstored.router")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="kvstored-router",
                                     description="Route each request to the kvstored node where its TTFT is lowest.")
    parser.add_argument("--config", help="TOML config file (default: /etc/kvstored/kvstored.toml if present)")
    parser.add_argument("--no-config", action="store_true", help="embedded defaults and flags only")
    parser.add_argument("--listen", help="HTTP API host:port (router.listen)")
    parser.add_argument("--source", action="append", default=[], metavar="NODE=PUB[,REPLAY]",
                        help="a daemon's KV events (router.sources; repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config key (repeatable)")
    parser.add_argument("--print-config", action="store_true", help="print the [router] section in effect and exit")
    args = parser.parse_args(argv)
    if args.no_config and args.config:
        parser.error("--config and --no-config exclude each other")
    overrides = list(args.set)
    if args.listen:
        overrides.append(f"router.listen={args.listen}")
    return args, overrides


def _load(args: argparse.Namespace, overrides: list[str]) -> Config:
    cfg = config_mod.load(args.config, overrides, system=not args.no_config)
    if args.source:   # not through --set: a comma-separated list would cut a source's endpoints apart
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router,
                                                                  sources=cfg.router.sources + tuple(args.source)))
        config_mod.validate(cfg)
    return cfg


async def serve(cfg: Config) -> int:
    service = RouterService(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        await service.close()
        return 1
    host = cfg.router.listen.rpartition(":")[0]
    log.info("kvstored-router serving HTTP on %s:%d%s; %d event source(s)", host, service.port,
             f", gRPC on {cfg.router.grpc.rpartition(':')[0]}:{service.grpc_port}" if service.grpc_port else "",
             len(service.subscribers))
    await stop.wait()
    await service.close()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = _load(args, overrides)
    except ConfigError as exc:
        print(f"kvstored-router: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(dataclasses.asdict(cfg.router), indent=2))
        return 0
    logging.basicConfig(level=cfg.log.level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
