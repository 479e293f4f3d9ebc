"""Cluster membership against a real etcd on loopback (Debian's etcd-server; install it with
tools/ci/install-etcd.sh). Each test gets its own etcd on random ports with a temporary data dir.
A member that is SIGKILLed disappears when its lease expires; one that closes leaves at once.
The static list needs no etcd."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from loopback import free_ports

from kvstored.cluster.membership import EtcdMembership, Member, MembershipError, StaticMembership

ROOT = Path(__file__).resolve().parents[2]
TTL_S = 2


async def next_change(it: AsyncIterator[tuple[Member, ...]], timeout: float) -> tuple[Member, ...]:
    async with asyncio.timeout(timeout):
        return await anext(it)


async def until(it: AsyncIterator[tuple[Member, ...]], want: set[str], timeout: float) -> float:
    """Consume the watch until its members' ids are ``want``; return the seconds it took."""
    t0 = time.monotonic()
    async with asyncio.timeout(timeout):
        async for members in it:
            if {m.node_id for m in members} == want:
                return time.monotonic() - t0
    raise AssertionError("watch ended")


_MEMBER_PROCESS = """
import asyncio, sys
from kvstored.cluster.membership import EtcdMembership
async def main():
    m = EtcdMembership(sys.argv[1], sys.argv[2], sys.argv[3], ttl_s=int(sys.argv[4]))
    await m.start()
    print("registered", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def start_member_process(endpoint: str, node_id: str, address: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _MEMBER_PROCESS, endpoint, node_id, address, str(TTL_S)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    line = proc.stdout.readline()   # bounded: the child exits (EOF) if it cannot register
    if line.strip() != "registered":
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"member process did not register (exit {proc.poll()})")
    return proc


def test_two_members_register_and_a_killed_one_disappears(etcd: str) -> None:
    proc = start_member_process(etcd, "node-b", "127.0.0.1:7002")
    try:
        async def main() -> None:
            async with EtcdMembership(etcd, "node-a", "127.0.0.1:7001", ttl_s=TTL_S) as a:
                assert await a.members() == (Member("node-a", "127.0.0.1:7001"), Member("node-b", "127.0.0.1:7002"))
                assert await a.peers() == (Member("node-b", "127.0.0.1:7002"),)
                watch = a.watch()
                try:
                    assert {m.node_id for m in await next_change(watch, 5)} == {"node-a", "node-b"}
                    # a member that keeps its lease alive stays well past the TTL
                    await asyncio.sleep(TTL_S * 1.5)
                    assert {m.node_id for m in await a.members()} == {"node-a", "node-b"}
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                    took = await until(watch, {"node-a"}, timeout=TTL_S + 8)
                    assert took <= TTL_S + 5, f"dead member lingered {took:.1f}s"
                    assert await a.peers() == ()
                finally:
                    await watch.aclose()

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(10)


def test_clean_close_leaves_at_once(etcd: str) -> None:
    async def main() -> None:
        async with EtcdMembership(etcd, "node-a", "127.0.0.1:7001", ttl_s=30) as a:
            b = EtcdMembership(etcd, "node-b", "127.0.0.1:7002", ttl_s=30)
            await b.start()
            watch = a.watch()
            try:
                await until(watch, {"node-a", "node-b"}, timeout=5)
                await b.close()
                await b.close()   # idempotent
                took = await until(watch, {"node-a"}, timeout=5)
                assert took < 3   # revoked, not expired (the TTL is 30 s)
            finally:
                await watch.aclose()

    asyncio.run(main())


def test_lost_lease_is_renewed(etcd: str) -> None:
    import aetcd

    async def main() -> None:
        async with EtcdMembership(etcd, "node-a", "127.0.0.1:7001", ttl_s=TTL_S) as a:
            host, port = etcd.split(":")
            other = aetcd.Client(host, int(port))
            try:   # revoke its lease behind its back, as if it had been cut off past the TTL
                await other.revoke_lease(a._lease_id)
                assert await a.members() == ()
                async with asyncio.timeout(TTL_S + 5):
                    while not await a.members():
                        await asyncio.sleep(0.1)
                assert a.registrations == 2
                assert await a.members() == (Member("node-a", "127.0.0.1:7001"),)
            finally:
                await other.close()

    asyncio.run(main())


def test_unreachable_etcd_is_a_clear_error() -> None:
    async def main() -> None:
        m = EtcdMembership(f"127.0.0.1:{free_ports(1)[0]}", "node-a", "127.0.0.1:7001", ttl_s=TTL_S, timeout_s=2)
        t0 = time.monotonic()
        with pytest.raises(MembershipError, match="cannot register"):
            await m.start()
        assert time.monotonic() - t0 < 10
        await m.close()

    asyncio.run(main())


def test_static_membership() -> None:
    async def main() -> None:
        peers = [Member("b", "10.0.0.2:7000"), Member("a", "10.0.0.1:7000")]
        async with StaticMembership(peers, node_id="a") as m:
            assert await m.members() == (Member("a", "10.0.0.1:7000"), Member("b", "10.0.0.2:7000"))
            assert await m.peers() == (Member("b", "10.0.0.2:7000"),)
            watch = m.watch()
            assert len(await next_change(watch, 1)) == 2
            nxt = asyncio.ensure_future(anext(watch))
            await asyncio.sleep(0.05)
            assert not nxt.done()            # no changes, ever ...
            await m.close()
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(nxt, 1)   # ... until closed
        with pytest.raises(ValueError, match="duplicate"):
            StaticMembership([Member("a", "x:1"), Member("a", "y:1")])

    asyncio.run(main())


def test_member_records() -> None:
    m = Member("n1", "127.0.0.1:7000")
    assert Member.decode(m.encode()) == m
    for bad in (b"", b"[]", b'{"node_id": 1, "address": "x"}', b'{"address": "x"}'):
        with pytest.raises(ValueError):
            Member.decode(bad)
    with pytest.raises(ValueError):
        EtcdMembership("nohost", "n", "a")
    with pytest.raises(ValueError):
        EtcdMembership("127.0.0.1:2379", "a/b", "a")
