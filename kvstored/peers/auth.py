"""How peers prove who they are: mutual TLS (certificates, contexts), a shared token, listener safety."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass

from kvstored.addresses import is_loopback
from kvstored.peers.errors import PeerConfigError

log = logging.getLogger("kvstored.peers")


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files for mutual TLS. A server needs all three; a client without ``cert_file`` presents
    no certificate (and a server requiring one refuses it). ``server_name``: the name to verify in
    the server's certificate; "" = the host we connect to."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""


@dataclass(frozen=True, slots=True)
class PeerAuth:
    """How peers prove who they are: mutual TLS, a shared token, both, or (loopback or explicitly
    ``insecure``) neither."""

    tls: TLSFiles | None = None
    token: str = ""
    insecure: bool = False

    @property
    def authenticated(self) -> bool:
        return self.tls is not None or bool(self.token)

    def server_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        if not (self.tls.cert_file and self.tls.key_file and self.tls.ca_file):
            raise PeerConfigError("peer TLS on a listener needs ca_file, cert_file and key_file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)   # trusts ca_file only (no system roots)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load(ctx, self.tls)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.sslobject_class = _LoggedHandshake   # the refusing side says why, too
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        # Not create_default_context: it loads the host's public roots too, and a certificate
        # any of them issued for a peer's address would pass. Peers are trusted via ca_file alone.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # CERT_REQUIRED, check_hostname
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load(ctx, self.tls)
        return ctx


class _LoggedHandshake(ssl.SSLObject):
    """A server-side TLS session that logs why it refused a peer (its certificate expired, was
    signed by another CA, ...): otherwise only the connecting side would learn it."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise   # the handshake is still under way
        except ssl.SSLError as exc:
            reason = getattr(exc, "verify_message", "") or exc.reason or str(exc)
            if "ALERT" in str(exc.reason or ""):   # the peer refused ours (it sent an alert)
                log.warning("a peer refused this node's TLS handshake: %s", reason)
            else:
                log.warning("refused a peer's TLS handshake: %s", reason)
            raise


def certificate_warning(cert_file: str, now: float) -> str:
    """Why this node's own certificate will be refused by its peers (expired, not yet valid), or
    "" when its dates are fine or cannot be read."""
    try:
        info = ssl._ssl._test_decode_cert(cert_file)  # type: ignore[attr-defined]  # stdlib's PEM reader
        not_before = ssl.cert_time_to_seconds(info["notBefore"])
        not_after = ssl.cert_time_to_seconds(info["notAfter"])
    except Exception:
        return ""
    if now > not_after:
        return f"the peer certificate {cert_file} expired on {info['notAfter']}: peers will refuse it"
    if now < not_before:
        return f"the peer certificate {cert_file} is not valid before {info['notBefore']}: peers will refuse it"
    return ""


def _load(ctx: ssl.SSLContext, files: TLSFiles) -> None:
    try:
        ctx.load_verify_locations(cafile=files.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise PeerConfigError(f"cannot load the peer CA file {files.ca_file!r}: {exc}") from None
    if files.cert_file or files.key_file:
        try:
            ctx.load_cert_chain(files.cert_file, files.key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise PeerConfigError(f"cannot load the peer certificate {files.cert_file!r} / key "
                                  f"{files.key_file!r}: {exc}") from None


def listener_allowed(host: str, auth: PeerAuth) -> bool:
    """A listener may serve peers on ``host`` if it authenticates them, listens only on loopback,
    or the configuration explicitly says ``insecure``."""
    return auth.authenticated or auth.insecure or is_loopback(host)
