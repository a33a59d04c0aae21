"""Transport security for every hop: mutual TLS on gRPC, credentials and TLS on NATS.

Off by default (loopback development); on when the environment names the files, which is how
the launcher (a run file's ``security:`` section), compose and Kubernetes turn it on for each
service process:

    RLFLEET_TLS_CA      PEM file of the CA that signs every service certificate
    RLFLEET_TLS_CERT    this service's certificate (PEM), used as server and as client
    RLFLEET_TLS_KEY     its private key (PEM)
    RLFLEET_NATS_USER   NATS user name for this service
    RLFLEET_NATS_PASSWORD   its password

With TLS on, a gRPC server requires a client certificate signed by the CA (mutual TLS) and a
client checks the server's certificate against the CA and the address it dials (the
certificate's subject alternative names: see launch/certs.py). The same files secure the
NATS connection. Naming only some of the three TLS files is an error, never a silent
downgrade to plaintext.

Certificates the launcher makes also say who holds them: a URI subject alternative name
``spiffe://rlfleet/<run>/<kind>/<name>`` (`Identity`). A server whose own certificate carries
one checks each caller's (services/server.py): a caller of another run is refused, and so is
a kind a servicer's ``CALLERS`` (method -> kinds) does not list for the method called.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.errors import ConfigError

__all__ = [
    "GAME_CLIENT",
    "LAUNCHER_KIND",
    "Callers",
    "Identity",
    "NatsCredentials",
    "TlsFiles",
    "cert_identity",
    "channel_credentials",
    "nats_credentials",
    "server_credentials",
    "ssl_context",
    "tls_files",
]

TLS_ENV = ("RLFLEET_TLS_CA", "RLFLEET_TLS_CERT", "RLFLEET_TLS_KEY")
NATS_USER_ENV, NATS_PASSWORD_ENV = "RLFLEET_NATS_USER", "RLFLEET_NATS_PASSWORD"
IDENTITY_PREFIX = "spiffe://rlfleet/"
# Kinds that are no service kind: the launcher (health checks, dashboard, admin calls) and the
# games that connect to a GameLink from outside the run (`rlfleet certs --kind game_client`).
LAUNCHER_KIND, GAME_CLIENT = "launcher", "game_client"
# What a servicer declares as ``CALLERS``: method name -> the kinds that may call it. Methods it
# does not name, and servicers without a declaration, are open to every kind of the run.
Callers = Mapping[str, frozenset[str]]


@dataclass(frozen=True)
class Identity:
    """Who holds a certificate: an instance ``name`` of service ``kind`` in ``run``."""

    run: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"{IDENTITY_PREFIX}{self.run}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, uri: str) -> Identity | None:
        if not uri.startswith(IDENTITY_PREFIX):
            return None
        parts = uri[len(IDENTITY_PREFIX) :].split("/")
        return cls(*parts) if len(parts) == 3 and all(parts) else None


@functools.lru_cache(maxsize=256)
def cert_identity(pem: bytes) -> Identity | None:
    """The rlfleet identity a PEM certificate names, or None (none, or not a certificate)."""
    from cryptography import x509  # loaded with the first TLS peer, not with every service

    try:
        cert = x509.load_pem_x509_certificate(pem)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    uris = names.get_values_for_type(x509.UniformResourceIdentifier)
    return next((i for i in map(Identity.parse, uris) if i is not None), None)


@dataclass(frozen=True)
class TlsFiles:
    """The CA, certificate and key a process presents and trusts."""

    ca: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        """The environment that hands these files to a child process."""
        return dict(zip(TLS_ENV, (str(self.ca), str(self.cert), str(self.key)), strict=True))

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for name, path in zip(TLS_ENV, (self.ca, self.cert, self.key), strict=True):
            try:
                out.append(path.read_bytes())
            except OSError as exc:
                raise ConfigError(f"{name}={path}: cannot read: {exc.strerror}") from exc
        return out[0], out[1], out[2]


@dataclass(frozen=True)
class NatsCredentials:
    user: str
    password: str

    def env(self) -> dict[str, str]:
        return {NATS_USER_ENV: self.user, NATS_PASSWORD_ENV: self.password}


def tls_files(environ: os._Environ[str] | dict[str, str] | None = None) -> TlsFiles | None:
    """The TLS files the environment names, or None when it names none."""
    env = os.environ if environ is None else environ
    values = [env.get(name, "") for name in TLS_ENV]
    if not any(values):
        return None
    missing = [name for name, value in zip(TLS_ENV, values, strict=True) if not value]
    if missing:
        raise ConfigError(
            f"TLS is half configured: {', '.join(missing)} not set (set all of "
            f"{', '.join(TLS_ENV)}, or none for plaintext)"
        )
    return TlsFiles(*(Path(v) for v in values))


def nats_credentials(
    environ: os._Environ[str] | dict[str, str] | None = None,
) -> NatsCredentials | None:
    env = os.environ if environ is None else environ
    user, password = env.get(NATS_USER_ENV, ""), env.get(NATS_PASSWORD_ENV, "")
    if not user and not password:
        return None
    if not user or not password:
        raise ConfigError(f"set both {NATS_USER_ENV} and {NATS_PASSWORD_ENV}, or neither")
    return NatsCredentials(user, password)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Server side of mutual TLS: present our certificate, require one signed by the CA."""
    ca, cert, key = tls.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Client side of mutual TLS: trust the CA, present our certificate."""
    ca, cert, key = tls.read()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def ssl_context(tls: TlsFiles, *, server: bool = False) -> ssl.SSLContext:
    """An ssl context for NATS (client) with the same CA and certificate."""
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    context = ssl.create_default_context(purpose, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
