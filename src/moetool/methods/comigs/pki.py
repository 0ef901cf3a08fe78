"""Certificates and keys for a CoMiGS Flower deployment: a local CA, the SuperLink's TLS certificate signed by it,
and one EC key pair per SuperNode for Flower's node authentication.

This is what Flower's ``generate_creds.sh`` does with openssl, done with ``cryptography`` (a flwr dependency, so it
is present in .venv-flwr) so that the launcher needs no openssl binary. On real machines the CA key stays with whoever
runs the SuperLink; each device keeps its own private key and hands over only its ``.pub`` file.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Flower's node authentication accepts NIST curves only (flwr.supercore.primitives.asymmetric.uses_nist_ec_curve)
_CURVE = ec.SECP384R1()


@dataclass(frozen=True)
class ServerCredentials:
    ca_cert: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class NodeKeys:
    private: Path  # OpenSSH private key: `flower-supernode --auth-supernode-private-key`
    public: Path  # OpenSSH public key: `flwr supernode register`


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # a private key is created 0600 from the start, never readable by others even for a moment
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "moetool comigs"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_server_credentials(out: Path, hosts: list[str], *, days: int = 30) -> ServerCredentials:
    """A fresh CA and a server certificate for ``hosts`` (IP addresses or DNS names, all put in the SAN, which is what
    TLS clients check). Written as PEM: ``ca.crt``, ``ca.key``, ``server.pem``, ``server.key``."""
    if not hosts:
        raise ValueError("make_server_credentials: no host names for the certificate's subjectAltName")
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(_CURVE)
    ca_name = _name("moetool comigs local CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(_CURVE)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    plain = serialization.NoEncryption()
    creds = ServerCredentials(ca_cert=out / "ca.crt", cert=out / "server.pem", key=out / "server.key")
    _write(creds.ca_cert, ca_cert.public_bytes(pem), secret=False)
    _write(out / "ca.key", ca_key.private_bytes(pem, pkcs8, plain), secret=True)
    _write(creds.cert, cert.public_bytes(pem), secret=False)
    _write(creds.key, key.private_bytes(pem, pkcs8, plain), secret=True)
    return creds


def make_node_keys(out: Path, name: str) -> NodeKeys:
    """An EC P-384 key pair in OpenSSH format (what ``flower-supernode`` and ``flwr supernode register`` read)."""
    key = ec.generate_private_key(_CURVE)
    keys = NodeKeys(private=out / f"{name}.key", public=out / f"{name}.pub")
    ssh = serialization.Encoding.OpenSSH
    _write(
        keys.private,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
        secret=True,
    )
    _write(keys.public, key.public_key().public_bytes(ssh, serialization.PublicFormat.OpenSSH) + b"\n", secret=False)
    return keys
