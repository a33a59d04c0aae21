"""What the launcher sets up for a run file's ``security:`` section: certificates for every
service, a NATS user per service, and the environment that hands each its own.

With ``tls``: a CA and one certificate per service instance (plus ``nats`` for the embedded
server and ``launcher`` for the launcher's own health checks and monitor), each naming its
holder's run, kind and name (services/security.py `Identity`, which servers check callers
against), made once in the certificates folder and reused by later starts. With ``nats_auth``:
a random password per service for this launcher's lifetime, written only into the embedded
server's configuration (mode 0600) and into each child's environment; services whose kind uses
the bus get their kind's `service_permissions` (services/bus/subjects.py: the run's subjects
only, what the kind needs), the others no NATS user at all, the launcher full rights. Since
only the launcher and the learner may create streams then, the launcher creates the run's
streams and buckets before any service starts (`create_streams`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from launch.certs import ensure_certs
from services.bus import Bus, NatsUser, service_permissions, stream_name, traj_subject
from services.bus.images import ImageStore
from services.bus.subjects import KIND_RIGHTS, work_queue_stream, work_queue_subject
from services.config import RunConfig, ServiceEntry
from services.membership import ensure_bucket
from services.registry import get_service
from services.security import LAUNCHER_KIND, Identity, NatsCredentials, TlsFiles

__all__ = ["LAUNCHER", "RunSecurity"]

LAUNCHER, NATS = "launcher", "nats"


@dataclass
class RunSecurity:
    run: str
    tls: dict[str, TlsFiles] = field(default_factory=dict)  # instance name -> files
    nats: dict[str, NatsCredentials] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # instance name -> service kind
    queues: tuple[str, ...] = ()  # the run's prompt work queues

    @classmethod
    def prepare(cls, config: RunConfig, run_dir: Path) -> RunSecurity:
        """Certificates for every instance; NATS users for those whose kind uses the bus."""
        section = config.security
        names = [e.name for e in config.services] + [LAUNCHER]
        bus_users = [e.name for e in config.services if _uses_bus(e)] + [LAUNCHER]
        out = cls(config.run.name)
        out.kinds = {e.name: e.service for e in config.services}
        out.queues = _queues(config)
        if section.tls:
            folder = section.certs_dir or run_dir / "certs"
            kinds = {**out.kinds, LAUNCHER: LAUNCHER_KIND, NATS: NATS}
            identities = {n: Identity(out.run, kinds[n], n) for n in [*names, NATS]}
            out.tls = ensure_certs(folder, [*names, NATS], section.hosts, identities)
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
            if name == LAUNCHER:
                rights = {}
            else:
                kind = self.kinds[name]
                rights = service_permissions(self.run, kind, creds.user, queues=self.queues)
            users.append(NatsUser(creds.user, creds.password, **rights))
        return users

    async def create_streams(self, url: str) -> None:
        """With NATS auth: the run's trajectory stream and its payload bucket, its membership
        bucket, and each prompt queue with its feeder's cursor bucket (and the run's image
        bucket), as the services would make them on first use (services may use but not create
        them)."""
        if not self.nats:
            return
        async with Bus.connect(url, name="rlfleet-launcher") as bus:
            traj = traj_subject(self.run)
            await bus.ensure_stream(stream_name(self.run), [traj])
            await bus.payloads.ensure(traj)
            await ensure_bucket(bus, self.run)
            if self.queues:  # prompts may hold images, stored by the feeder
                await ImageStore(bus.payloads, self.run).ensure()
            for queue in self.queues:
                stream = work_queue_stream(self.run, queue)
                subject = work_queue_subject(self.run, queue)
                await bus.ensure_stream(stream, [subject], retention="workqueue")
                await bus.kv(f"{stream}-FEED")


def _queues(config: RunConfig) -> tuple[str, ...]:
    """Prompt work queue names the run's services name in their settings (rollout's `queue`)."""
    kinds = {k for k, rights in KIND_RIGHTS.items() if "take_queue" in rights}
    names = (getattr(e.settings, "queue", None) for e in config.services if e.service in kinds)
    return tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))


def _uses_bus(entry: ServiceEntry) -> bool:
    return bool(get_service(entry.service).uses_bus(entry.settings))
