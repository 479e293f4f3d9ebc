"""Peer authentication on loopback: mutual TLS with generated certificates, shared tokens, listener
safety."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pki as test_pki
import pytest
from peer_channel import (
    NS,
    PKI,
    Blocks,
    Collector,
    chain,
    key,
    make_pki,
    run,
    tls,
)

from kvstored.peers.auth import PeerAuth, listener_allowed
from kvstored.peers.connection import fetch
from kvstored.peers.errors import PeerAuthError, PeerConfigError
from kvstored.peers.server import BlockServer


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory)


def _with_server(server_auth: PeerAuth, client: Callable[[tuple[str, int]], Awaitable[None]],
                 use_uvloop: bool = False) -> None:
    _keys, data = chain(3, 64 << 10)

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, server_auth, Blocks(data).serve) as srv:
            await client(srv.address)

    run(main(), use_uvloop)


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_mutual_tls_transfer(pki: PKI, use_uvloop: bool) -> None:
    async def client(addr: tuple[str, int]) -> None:
        got = Collector()
        res = await fetch(addr, tls(pki.ca, pki.client), NS, [key(0), key(1), key(2)], got, 10)
        assert res.complete and len(got.got) == 3
    _with_server(tls(pki.ca, pki.server), client, use_uvloop)


@pytest.mark.parametrize("case, match", [
    ("wrong_ca", "not trusted"),
    ("expired_server", "expired"),
    ("expired_client", "our TLS certificate"),
    ("missing_client_cert", "our TLS certificate"),
    ("foreign_client", "our TLS certificate"),
    ("plain_client", "closed the connection during authentication"),
    ("tls_client_plain_server", "TLS handshake failed"),
])
@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_bad_tls_credentials_are_refused(pki: PKI, case: str, match: str, use_uvloop: bool) -> None:
    server = tls(pki.ca, pki.expired_server if case == "expired_server" else pki.server)
    if case == "tls_client_plain_server":
        server = PeerAuth(token="t")
    client_auth = {
        "wrong_ca": tls(pki.other_ca, pki.client),
        "expired_server": tls(pki.ca, pki.client),
        "expired_client": tls(pki.ca, pki.expired_client),
        "missing_client_cert": tls(pki.ca, None),
        "foreign_client": tls(pki.ca, pki.foreign_client),
        "plain_client": PeerAuth(),
        "tls_client_plain_server": tls(pki.ca, pki.client),
    }[case]

    async def client(addr: tuple[str, int]) -> None:
        t0 = time.monotonic()
        with pytest.raises(PeerAuthError, match=match):
            await fetch(addr, client_auth, NS, [key(0)], Collector(), 10)
        assert time.monotonic() - t0 < 5   # refused promptly, not by a timeout

    _with_server(server, client, use_uvloop)


def test_unreadable_tls_files_are_a_config_error(pki: PKI, tmp_path: Path) -> None:
    with pytest.raises(PeerConfigError, match="certificate"):
        tls(pki.ca, (str(tmp_path / "nope.pem"), str(tmp_path / "nope.key"))).server_context()
    with pytest.raises(PeerConfigError, match="CA file"):
        tls(str(tmp_path / "nope-ca.pem"), pki.client).client_context()
    with pytest.raises(PeerConfigError, match="needs"):
        tls(pki.ca, None).server_context()


@pytest.mark.parametrize("presented, match", [
    ("s3cret-token", None),
    ("wrong-token", "token rejected"),
    ("", "requires a shared token"),
])
def test_shared_token(presented: str, match: str | None) -> None:
    async def client(addr: tuple[str, int]) -> None:
        auth = PeerAuth(token=presented)
        if match is None:
            res = await fetch(addr, auth, NS, [key(0)], Collector(), 10)
            assert res.complete
        else:
            with pytest.raises(PeerAuthError, match=match):
                await fetch(addr, auth, NS, [key(0)], Collector(), 10)

    _with_server(PeerAuth(token="s3cret-token"), client)


def test_token_over_tls(pki: PKI) -> None:
    server = PeerAuth(tls=tls(pki.ca, pki.server).tls, token="t0ken")

    async def client(addr: tuple[str, int]) -> None:
        good = PeerAuth(tls=tls(pki.ca, pki.client).tls, token="t0ken")
        assert (await fetch(addr, good, NS, [key(0)], Collector(), 10)).complete
        with pytest.raises(PeerAuthError, match="token"):
            await fetch(addr, PeerAuth(tls=good.tls), NS, [key(0)], Collector(), 10)

    _with_server(server, client)


def test_listener_safety() -> None:
    # No bind happens for a refused listener, so no test listens beyond loopback.
    async def main() -> None:
        for host in ("0.0.0.0", "::", "", "10.1.2.3", "peer.example"):
            with pytest.raises(PeerConfigError, match="insecure = true"):
                await BlockServer(host, 0, PeerAuth(), Blocks({}).serve).start()
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve):
            pass   # loopback needs no credentials

    run(main())
    assert listener_allowed("0.0.0.0", PeerAuth(insecure=True))
    assert listener_allowed("0.0.0.0", PeerAuth(token="x"))
    assert not listener_allowed("0.0.0.0", PeerAuth())
    assert listener_allowed("::1", PeerAuth()) and listener_allowed("localhost", PeerAuth())


def test_a_peer_certificate_from_a_ca_the_host_trusts_is_refused(pki: PKI, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Peers are trusted through peers.tls_ca alone. A CA the host trusts (the system bundle, here
    # SSL_CERT_FILE) must not let a certificate it issued for a peer's address pass as a peer:
    # the client would send its token to, and fetch KV blocks from, whoever holds it.
    public_ca = test_pki.make_ca("a public root the host trusts")
    monkeypatch.setenv("SSL_CERT_FILE", test_pki.write(tmp_path, "public-ca", public_ca, with_key=False)[0])
    impostor = test_pki.write(tmp_path, "impostor", test_pki.make_leaf("impostor", public_ca, server=True,
                                                                        client=False))

    async def client(addr: tuple[str, int]) -> None:
        with pytest.raises(PeerAuthError, match="not trusted"):
            await fetch(addr, tls(pki.ca, pki.client), NS, [key(0)], Collector(), 10)

    _with_server(tls(pki.ca, impostor), client)
