"""Certificates for peer TLS on a test or benchmark bench: a CA, and leaf certificates it signs
(for localhost / 127.0.0.1), written as PEM files. Not for production clusters: their CA is the
operator's.

Uses the ``cryptography`` package (a dev dependency); ``available`` says whether it is installed."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError:  # pragma: no cover
    x509 = None  # type: ignore[assignment]

available = x509 is not None

Issued = tuple[Any, Any]   # (certificate, private key)


def _name(cn: str) -> Any:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(cn: str, issuer_name: Any, key: Any, days: tuple[int, int], ca: bool) -> Any:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=days[0]))
            .not_valid_after(now + datetime.timedelta(days=days[1]))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))


def make_ca(cn: str) -> Issued:
    """A self-signed CA valid from yesterday for 30 days."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(cn, _name(cn), key, (-1, 30), ca=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_leaf(cn: str, issuer: Issued, *, server: bool, client: bool, days: tuple[int, int] = (-1, 30)) -> Issued:
    """A certificate for localhost / 127.0.0.1 signed by ``issuer``, good for the TLS server end,
    the client end, or both; ``days``: validity from/to, relative to today."""
    issuer_cert, issuer_key = issuer
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [oid for oid, wanted in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                      (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if wanted]
    cert = (_builder(cn, issuer_cert.subject, key, days, ca=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
            .sign(issuer_key, hashes.SHA256()))
    return cert, key


def write(directory: Path, name: str, issued: Issued, with_key: bool = True) -> tuple[str, str]:
    """``name.pem`` (and ``name.key`` with ``with_key``) in ``directory``; their paths ("" for no key)."""
    cert, key = issued
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if not with_key:
        return str(directory / f"{name}.pem"), ""
    (directory / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    return str(directory / f"{name}.pem"), str(directory / f"{name}.key")


def mutual(directory: Path) -> tuple[str, str, str, str, str]:
    """A fresh CA and one leaf good for both ends of a connection, in ``directory``:
    (CA file, server cert, server key, client cert, client key)."""
    ca = make_ca("kvstored bench CA")
    ca_file = write(directory, "ca", ca, with_key=False)[0]
    server = write(directory, "server", make_leaf("server", ca, server=True, client=False))
    client = write(directory, "client", make_leaf("client", ca, server=False, client=True))
    return ca_file, *server, *client
