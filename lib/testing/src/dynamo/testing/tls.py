"""A throw-away certificate authority for tests of TLS connections.

`make_test_pki(directory)` writes a self-signed CA, a server certificate for `localhost`
and 127.0.0.1, and a client certificate, all signed by that CA, as PEM files: what a
nats-server with TLS (and client verification) and its clients need. Keys are small
EC keys, so this takes milliseconds; the certificates are valid for a day.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class TestPki:
    """PEM files of one test CA and the certificates it signed."""

    __test__ = False  # not a pytest test class, despite the name

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_test_pki(directory: Path, *, server_names: tuple[str, ...] = ("localhost",)) -> TestPki:
    """Write a CA, a server certificate (for `server_names` and 127.0.0.1) and a client
    certificate into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("dynamo test CA")
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    server = _leaf(ca_cert, ca_key, "nats-server", ExtendedKeyUsageOID.SERVER_AUTH, names, now)
    client = _leaf(ca_cert, ca_key, "dynamo client", ExtendedKeyUsageOID.CLIENT_AUTH, [], now)
    pki = TestPki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
    )
    _write_cert(pki.ca, ca_cert)
    _write_cert(pki.server_cert, server[0])
    _write_key(pki.server_key, server[1])
    _write_cert(pki.client_cert, client[0])
    _write_key(pki.client_key, client[1])
    return pki


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName],
    now: datetime.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(_name(common_name), ca_cert.subject, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
