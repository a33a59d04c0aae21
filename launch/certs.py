"""`rlfleet certs OUT --name NAME ...`: a local CA and one certificate per service, for
development, tests and the launcher's `security: {tls: true}`.

Each certificate serves as both server and client certificate (mutual TLS), carries its service
name as common name, and lists as subject alternative names the service name, ``localhost``,
``127.0.0.1`` and ``::1`` plus any ``--host`` given (the DNS names of a compose or Kubernetes
deployment), and, given a run and kind, the holder's identity as the URI
``spiffe://rlfleet/<run>/<kind>/<name>`` that servers check callers against
(services/security.py `Identity`). Keys are ECDSA P-256; the CA lives ten years, certificates
one. Production deployments bring certificates from their own CA (cert-manager, Vault): the
services only read PEM files (services/security.py).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.commands import Command
from services.errors import ConfigError
from services.security import Identity, TlsFiles, cert_identity

__all__ = ["CERTS", "ensure_certs"]

CA_FILE, CA_KEY_FILE = "ca.pem", "ca-key.pem"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


CaPair = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600)
    os.chmod(path, 0o600)
    path.write_bytes(data)


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def _load_or_make_ca(out: Path) -> CaPair:
    if (out / CA_FILE).exists() and (out / CA_KEY_FILE).exists():
        cert = x509.load_pem_x509_certificate((out / CA_FILE).read_bytes())
        key = serialization.load_pem_private_key((out / CA_KEY_FILE).read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{out / CA_KEY_FILE}: not an EC private key")
        return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlfleet local CA")])
    start, end = _validity(3650)
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / CA_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out / CA_KEY_FILE, _pem_key(key))
    return cert, key


def _san(hosts: Iterable[str], identity: Identity | None = None) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    if identity is not None:
        names.append(x509.UniformResourceIdentifier(identity.uri))
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _issue(
    out: Path, ca: CaPair, name: str, hosts: Iterable[str], identity: Identity | None = None
) -> TlsFiles:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(365)
    both_ends = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    usage = x509.ExtendedKeyUsage(both_ends)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(_san([name, *hosts], identity)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(out / CA_FILE, out / f"{name}.pem", out / f"{name}-key.pem")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.key, _pem_key(key))
    return files


def ensure_certs(
    out: Path,
    names: Iterable[str],
    hosts: Iterable[str] = (),
    identities: Mapping[str, Identity] | None = None,
) -> dict[str, TlsFiles]:
    """The CA in ``out`` (made once) and a certificate per name (made when missing, or when it
    names another identity than ``identities`` gives the name: a service whose kind changed
    must not keep the old kind's rights)."""
    hosts = (*DEFAULT_HOSTS, *hosts)
    ca = _load_or_make_ca(out)
    issued = {}
    for name in names:
        identity = (identities or {}).get(name)
        files = TlsFiles(out / CA_FILE, out / f"{name}.pem", out / f"{name}-key.pem")
        usable = files.cert.exists() and files.key.exists()
        if usable and identity is not None:
            usable = cert_identity(files.cert.read_bytes()) == identity
        issued[name] = files if usable else _issue(out, ca, name, hosts, identity)
    return issued


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="folder for ca.pem, ca-key.pem, NAME.pem, NAME-key.pem")
    parser.add_argument(
        "--name", action="append", required=True, help="whom to issue a certificate for; repeatable"
    )
    parser.add_argument(
        "--host", action="append", default=[], help="extra DNS name or IP for every certificate"
    )
    parser.add_argument("--run", help="run the certificates are for (with --kind)")
    parser.add_argument(
        "--kind", help="service kind of every --name (e.g. game_client), checked by servers"
    )


def _run(args: argparse.Namespace) -> int:
    for name in args.name:
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"--name {name!r}: not a usable file name")
    if bool(args.run) != bool(args.kind):
        raise ConfigError("--run and --kind go together")
    identities = {n: Identity(args.run, args.kind, n) for n in args.name} if args.run else None
    issued = ensure_certs(Path(args.out_dir), args.name, args.host, identities)
    for name, files in issued.items():
        env = " ".join(f"{k}={v}" for k, v in files.env().items())
        print(f"{name}: {env}")
    return 0


CERTS = Command("make a local CA and per-service TLS certificates (mutual TLS)", _args, _run)
