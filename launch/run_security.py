"""What the launcher sets up for a run file's ``security:`` section: certificates for every
service, a NATS user per service, and the environment that hands each its own.

With ``tls``: a CA and one certificate per service instance (plus ``nats`` for the embedded
server and ``launcher`` for the launcher's own health checks and monitor), made once in the
certificates folder and reused by later starts. With ``nats_auth``: a random password per
service for this launcher's lifetime, written only into the embedded server's configuration
(mode 0600) and into each child's environment; services whose kind uses the bus get
`service_permissions` (the run's subjects only, no stream deletes or purges), the others no
NATS user at all, the launcher full rights.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from launch.certs import ensure_certs
from services.bus import NatsUser, service_permissions
from services.config import RunConfig, ServiceEntry
from services.registry import get_service
from services.security import NatsCredentials, TlsFiles

__all__ = ["LAUNCHER", "RunSecurity"]

LAUNCHER, NATS = "launcher", "nats"


@dataclass
class RunSecurity:
    run: str
    tls: dict[str, TlsFiles] = field(default_factory=dict)  # instance name -> files
    nats: dict[str, NatsCredentials] = field(default_factory=dict)

    @classmethod
    def prepare(cls, config: RunConfig, run_dir: Path) -> RunSecurity:
        """Certificates for every instance; NATS users for those whose kind uses the bus."""
        section = config.security
        names = [e.name for e in config.services] + [LAUNCHER]
        bus_users = [e.name for e in config.services if _uses_bus(e)] + [LAUNCHER]
        out = cls(config.run.name)
        if section.tls:
            folder = section.certs_dir or run_dir / "certs"
            out.tls = ensure_certs(folder, [*names, NATS], section.hosts)
        if section.nats_auth:
            out.nats = {n: NatsCredentials(n, secrets.token_urlsafe(24)) for n in bus_users}
        return out

    @property
    def enabled(self) -> bool:
        return bool(self.tls or self.nats)

    def env(self, name: str) -> dict[str, str]:
        """Environment of instance ``name`` (or LAUNCHER): its certificate and NATS user."""
        env: dict[str, str] = {}
        if name in self.tls:
            env.update(self.tls[name].env())
        if name in self.nats:
            env.update(self.nats[name].env())
        return env

    def nats_server_tls(self) -> TlsFiles | None:
        return self.tls.get(NATS)

    def nats_users(self) -> list[NatsUser]:
        users = []
        for name, creds in self.nats.items():
            rights = {} if name == LAUNCHER else service_permissions(self.run)
            users.append(NatsUser(creds.user, creds.password, **rights))
        return users


def _uses_bus(entry: ServiceEntry) -> bool:
    return bool(get_service(entry.service).uses_bus(entry.settings))
