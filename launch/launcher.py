"""``rlfleet up``: run a whole config on one machine, no Docker needed.

The launcher starts an embedded nats-server, or with ``nats.cluster`` a JetStream cluster of several
(services/bus/nats_cluster.py; unless the config names a server), waits until JetStream answers (a
cluster's meta leader), then every service as ``python -m services.serve KIND`` in its own process
group on a free loopback port, each process at once (its imports meanwhile) and each service's
start, at its start gate (services/start_gate.py), as soon as the services it needs are up (healthy,
for a gRPC service): independent services start together, and with nothing declared the start is in
config order, waiting for each gRPC service's health before the next (services/start_order.py
decides what waits for what). It supervises them (bounded restarts with backoff on a crash; none for
a service that exits ``EXIT_PERMANENT``, whose one-line reason fails the run), supervises each
embedded nats-server the same way (restarted on the same ports and store, so clients reconnect to it
and a cluster node rejoins its peers), ends the run when the ``main`` service exits, hands the run's
events to the console (launch/console.py: the progress line, ``--verbose`` event lines, ``<run
dir>/metrics.jsonl``), and on exit or Ctrl-C stops everything in reverse dependency order (SIGTERM
to the group, SIGKILL after a grace) so no process is left behind. Every child also gets a
parent-death signal (PR_SET_PDEATHSIG: SIGTERM for services, SIGKILL for nats-server), so none
outlives a SIGKILLed launcher. Services run exactly as a container would run them; only the env
differs.

The supervisor (start gating, health waits, restarts, ordered stop) is one state machine over
the same process table, and reads best in one place; what waits for what is
services/start_order.py's, what is shown the console's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from google.protobuf import json_format, struct_pb2

from launch.console import (
    Console,
    ServiceLine,
    compact,
    describe_start,
    direct_needs,
    progress_interval_from_env,
    verbose_from_env,
)
from launch.dashboard.live import LiveView
from launch.producers import ProducerWatch
from launch.run_security import LAUNCHER, RunSecurity
from launch.run_state import StateWriter
from rlfleet.bus.v1 import events_pb2
from services import registry as reg
from services.bus import (
    REPLICAS_ENV,
    RUN_OVER,
    TYPE_HEADER,
    Bus,
    EmbeddedNats,
    NatsCluster,
    events_wildcard,
    stream_replicas,
)
from services.bus.nats_server import parent_death_signal
from services.config import RunConfig, ServiceEntry, validate_run_config
from services.errors import EXIT_PERMANENT, ConfigError, RlfleetError, Unavailable
from services.placement import ENV_CPUS, format_cpus, replica_cpus
from services.ports import free_ports
from services.producers import PRODUCER_EVENTS, ProducerReport
from services.registry import ServiceSpec, get_job, get_service
from services.run_layout import RUN_CONFIG_FILE
from services.serve import ENV_EXIT_REASON
from services.server import wait_for_health
from services.start_gate import StartGate
from services.start_order import in_config_order, start_needs, stop_waves

__all__ = ["Launcher", "check_cpus"]

GRACE_S = 10.0
BACKOFF_S = 0.5  # first restart delay; doubles per restart of the same service, capped
MAX_BACKOFF_S = 10.0
NATS_POLL_S = 0.2  # how often the embedded nats-server is checked (and reaped once it exits)
# How long a fresh bus may take to answer JetStream requests: a cluster first elects its meta
# leader, which on a loaded machine can take a while.
JETSTREAM_WAIT_S = 60.0
TICK_S = 0.25  # how often a progress line held back by the interval is looked at
MONITOR_DRAIN_S = 5.0  # at the run's end, how long the monitor may take to read the last events
PRODUCERS_POLL_S = 0.5  # how often the launcher looks whether any producer is left


# --- one supervised service --------------------------------------------------------------------


@dataclass
class _Service:
    entry: ServiceEntry
    spec: ServiceSpec[Any]
    port: int
    metrics_port: int
    log_path: Path
    needs: tuple[str, ...] = ()  # instance names that must be up before it starts
    process: asyncio.subprocess.Process | None = None
    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    healthy_start: int = 0  # the start that last passed its health check (the dashboard)
    gate: StartGate | None = None  # the current process's start gate while it is shut

    @property
    def gated(self) -> bool:
        """Its process is up but not started yet (importing, or waiting for its needs)."""
        return self.gate is not None

    @property
    def name(self) -> str:
        return self.entry.name

    def status(self, stopping: bool) -> dict[str, Any]:
        """What the dashboard shows of this service; only reads (called from its thread)."""
        process = self.process
        code = process.returncode if process is not None else None
        if process is None or (code is None and self.gated):
            state = "waiting"
        elif code is None:
            running = "healthy" if self.healthy_start == self.starts else "starting"
            state = running if self.spec.grpc else "running"
        elif code == 0:
            state = "finished"
        elif stopping:
            state = "stopped"
        elif code == EXIT_PERMANENT or self.restarts >= self.entry.restarts:
            state = "failed"
        else:
            state = "restarting"
        return {
            "name": self.name,
            "kind": self.entry.service,
            "state": state,
            "restarts": self.restarts,
            "pid": process.pid if process is not None else None,
            "address": self.address if self.spec.grpc else None,
            "last_exit": _describe(self.exit_codes[-1]) if self.exit_codes else None,
        }

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def restarts(self) -> int:
        return max(self.starts - 1, 0)

    @property
    def reason_path(self) -> Path:
        """Where ``serve`` writes the one-line reason of a permanent failure."""
        return self.log_path.with_suffix(".reason")

    def permanent_reason(self) -> str:
        """The reason file's line, else the last line of the log."""
        for path in (self.reason_path, self.log_path):
            try:
                lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue
            last = next((line.strip() for line in reversed(lines) if line.strip()), "")
            if last:
                return last
        return "(no reason given)"


def check_cpus(config: RunConfig) -> None:
    """ConfigError naming the service whose ``cpus`` this process may not run on."""
    pinned = [(i, e) for i, e in enumerate(config.services) if e.cpus]
    if not pinned:
        return
    if not hasattr(os, "sched_getaffinity"):
        i, entry = pinned[0]
        raise ConfigError(f"services[{i}] ({entry.name}).cpus: CPU pinning needs Linux")
    usable = sorted(os.sched_getaffinity(0))
    for i, entry in pinned:
        missing = sorted(set(entry.cpus or ()) - set(usable))
        if missing:
            raise ConfigError(
                f"services[{i}] ({entry.name}).cpus: CPU {missing} not available here "
                f"(this process may use CPUs {usable})"
            )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _describe(code: int | None) -> str:
    if code is None:
        return "not started"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


async def _first(*aws: Awaitable[Any]) -> None:
    """Wait until the first of ``aws`` finishes; cancel the others (futures passed in are
    shielded: only the waiting is cancelled, not the future)."""
    tasks = [
        asyncio.shield(aw) if isinstance(aw, asyncio.Future) else asyncio.ensure_future(aw)
        for aw in aws
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Launcher:
    """Runs one RunConfig locally; ``run()`` returns the process exit code.

    0: the main service exited 0 (or, with no main service, the run was stopped by a signal or
    every service exited 0); 1: a service (or the embedded nats-server) failed after its
    restarts, failed permanently (``EXIT_PERMANENT``: not restarted) or never became healthy,
    or nothing can feed the main service any more (launch/producers.py; unless
    ``run.when_producers_gone`` is ``wait``); 130: stopped by a signal before the main service
    finished.
    """

    def __init__(
        self,
        config: RunConfig,
        config_path: str | os.PathLike[str] | None = None,
        *,
        out: IO[str] | None = None,
        environ: Mapping[str, str] | None = None,
        health_timeout_s: float | None = None,
        grace_s: float = GRACE_S,
        backoff_s: float = BACKOFF_S,
        verbose: bool | None = None,
        progress_interval_s: float | None = None,
        dashboard_port: int | None = None,
        tensorboard: bool = False,
    ) -> None:
        # Validate here too (cheap when already validated), so a config built in Python gets
        # the same before-anything-starts guarantee as a loaded file.
        self.config = validate_run_config(config, environ=environ)
        check_cpus(self.config)
        # Replicas of an engine that binds its threads (a kind's own_cpus), each on CPUs of its
        # own unless given `cpus` (services/placement.py replica_cpus).
        self._replica_cpus, self._placement_warning = (
            replica_cpus(
                self.config.services,
                sorted(os.sched_getaffinity(0)),
                [
                    e.name
                    for e in self.config.services
                    if get_service(e.service).own_cpus(e.settings)
                ],
            )
            if hasattr(os, "sched_getaffinity")
            else ({}, None)
        )
        self.config_path = Path(config_path) if config_path is not None else None
        self.out = out or sys.stdout
        self.environ = dict(os.environ if environ is None else environ)
        self._security = RunSecurity(self.config.run.name)  # made for real when the run starts
        # the run file's (run.health_timeout_s) unless a caller sets one
        self.health_timeout_s = health_timeout_s or self.config.run.health_timeout_s
        self.grace_s = grace_s
        self.backoff_s = backoff_s
        self.run_dir = config.run_dir.resolve()
        if verbose is None:
            verbose = verbose_from_env(self.environ)
        if progress_interval_s is None:
            progress_interval_s = progress_interval_from_env(self.environ)
        self.console = Console(
            self.out,
            config.run.name,
            verbose=verbose,
            interval_s=progress_interval_s,
            live=_is_terminal(self.out),
            metrics_path=self.run_dir / "metrics.jsonl",
        )
        self._services: list[_Service] = []
        self._by_name: dict[str, _Service] = {}
        self._say_starts = False  # print the start plan (set once the services are known)
        self._stop = asyncio.Event()
        self._monitor_stop = asyncio.Event()
        self._force = asyncio.Event()
        self._stopping = False
        self._outcome: asyncio.Future[int] | None = None
        self._end_message = ""  # why the run ended (the line _finish said)
        self._state = StateWriter(self.run_dir)  # <run dir>/state.json, for watchers
        self._producers: ProducerWatch | None = None  # None: nothing to watch (launch/producers.py)
        # The dashboard (dashboard_port; None: off, 0: a free port) and TensorBoard.
        self.live = LiveView(
            self.run_dir,
            dashboard_port=dashboard_port,
            tensorboard=tensorboard,
            status=self.service_status,
            say=self.say,
            environ=self.environ,
        )

    def service_status(self) -> list[dict[str, Any]]:
        """Every service's state for the dashboard (read-only; safe from another thread)."""
        return [svc.status(self._stopping) for svc in list(self._services)]

    def say(self, line: str) -> None:
        self.console.say(line)

    def run(self) -> int:
        """Run until the main service exits, a service fails for good, or Ctrl-C/SIGTERM."""
        return asyncio.run(self._main())

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # HUP: the terminal closed
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            return await self._run()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    async def _prepare_job(self) -> None:
        """The job kind's one-time preparation (files its services need), before they start."""
        job = self.config.job
        if not job:
            return
        spec = get_job(str(job["kind"]))
        if spec.prepare is None:
            return
        settings = spec.settings.model_validate({k: v for k, v in job.items() if k != "kind"})
        self.say(f"preparing job '{spec.kind}'")
        await asyncio.to_thread(spec.prepare, settings, self.run_dir)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stop.is_set():
            self.say(f"{sig.name} again: killing services now")
            self._force.set()
        else:
            self.say(f"{sig.name}: stopping (again to kill at once)")
            self._end_message = self._end_message or f"stopped by {sig.name}"
            self._stop.set()

    # --- the run -------------------------------------------------------------------------------

    async def _run(self) -> int:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        config_copy = self._write_config_copy()
        self._state.started()
        self._outcome = asyncio.get_running_loop().create_future()
        cluster: NatsCluster | None = None
        monitor: asyncio.Task[None] | None = None
        supervisors: list[asyncio.Task[None]] = []
        code = 1
        saved_environ = dict(os.environ)
        try:
            self._security = RunSecurity.prepare(self.config, self.run_dir)
            # The launcher's own health checks and monitor present the launcher's identity,
            # and the streams it creates are replicated like the services' (Bus.connect).
            os.environ.update(self._security.env(LAUNCHER))
            os.environ[REPLICAS_ENV] = str(self._replicas)
            if self.config.nats.url:
                url = self.config.nats.url
            else:
                # Started from the loop's thread: the parent-death signal follows that thread.
                cluster = NatsCluster(
                    self.run_dir / "nats",
                    self.config.nats.cluster,
                    die_with_parent=True,
                    tls=self._security.nats_server_tls(),
                    users=self._security.nats_users(),
                )
                await cluster.start_async()
                url = cluster.url
                for node in cluster.nodes:
                    supervisors.append(asyncio.create_task(self._supervise_nats(node)))
            size = self.config.nats.cluster
            shape = (
                f" ({size}-node JetStream cluster, {self._replicas} replicas)" if size > 1 else ""
            )
            self.say(f"run '{self.config.run.name}' in {self.run_dir}; NATS at {url}{shape}")
            await self._wait_for_jetstream(url, cluster)
            await self._security.create_streams(url)  # services may not, under NATS auth
            await self.live.start()
            await self._prepare_job()
            if self._replica_cpus:
                placed = ", ".join(
                    f"{name} on CPUs {format_cpus(cpus)}"
                    for name, cpus in self._replica_cpus.items()
                )
                warning = self._placement_warning
                self.say(f"placement: {placed}" + (f" ({warning})" if warning else ""))
            ports = free_ports(2 * len(self.config.services))
            needs = start_needs(self.config)
            for i, entry in enumerate(self.config.services):
                log_path = self.run_dir / "logs" / f"{entry.name}.log"
                spec = get_service(entry.service)
                svc = _Service(
                    entry, spec, ports[2 * i], ports[2 * i + 1], log_path, needs[entry.name]
                )
                self._services.append(svc)
                self._by_name[svc.name] = svc
            env = self._child_env(url, config_copy)
            self._producers = self._producer_watch()
            monitor = asyncio.create_task(self._monitor(url))
            if self._producers is not None:
                supervisors.append(asyncio.create_task(self._watch_producers(self._producers)))
            # The start plan and each held-back start, when they say more than "in order" (the
            # healthy/started lines already show a plain config-order start).
            self._say_starts = not in_config_order(self.config)
            if self._say_starts:
                self.say(f"starting {describe_start(list(needs), needs)}")
            # Every supervisor at once: each starts its service when what it needs is up.
            for svc in self._services:
                supervisors.append(asyncio.create_task(self._supervise(svc, env, config_copy)))
            await _first(self._outcome, self._stop.wait())
            if self._outcome.done():
                code = self._outcome.result()
            else:
                code = 0 if not any(s.entry.main for s in self._services) else 130
        finally:
            self._stopping = True
            for task in supervisors:
                task.cancel()
            await asyncio.gather(*supervisors, return_exceptions=True)
            await self._stop_all()
            await self.live.stop()
            if monitor is not None:
                # The services' last events (a driver's final metrics at its stop) may still be
                # on their way: the monitor reads what was sent before it stops.
                self._monitor_stop.set()
                try:
                    await asyncio.wait_for(asyncio.shield(monitor), MONITOR_DRAIN_S)
                except Exception:  # a timeout or a lost connection: what was read is kept
                    monitor.cancel()
                    await asyncio.gather(monitor, return_exceptions=True)
            self.console.close()  # the last progress line, then plain lines again
            final = self.console.progress_lines(final=True)
            self._state.update(
                figures=self.console.figures(final=True),
                line="\n".join(final),
                services=self.service_status(),
            )
            self._state.ended(code, self._end_message)
            if cluster is not None:
                await asyncio.to_thread(cluster.stop)
            os.environ.clear()
            os.environ.update(saved_environ)
            self._summary(code)
        return code

    def _write_config_copy(self) -> Path:
        """The config every service reads: a copy in the run dir, so the run is reproducible
        from its directory and a later edit of the original cannot reach a restarted service."""
        copy = self.run_dir / RUN_CONFIG_FILE
        if self.config_path is not None:
            if self.config_path.resolve() != copy:
                shutil.copyfile(self.config_path, copy)
        else:
            copy.write_text(yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False))
        return copy

    def _child_env(self, nats_url: str, config_copy: Path) -> dict[str, str]:
        env = dict(self.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # several processes share few cores
        env["PYTHONUNBUFFERED"] = "1"  # log lines reach the log file as they happen
        env[reg.ENV_RUN_NAME] = self.config.run.name
        env[reg.ENV_RUN_DIR] = str(self.run_dir)
        env[reg.ENV_RUN_CONFIG] = str(config_copy)
        env[reg.ENV_NATS_URL] = nats_url
        env[REPLICAS_ENV] = str(self._replicas)
        env[reg.ENV_ENDPOINTS] = json.dumps({s.name: s.address for s in self._services})
        env[reg.ENV_LAUNCHER_PID] = str(os.getpid())
        # Relative paths in settings (a `process` service's cwd) are relative to the run file.
        folder = self.config_path.resolve().parent if self.config_path else Path.cwd()
        env[reg.ENV_CONFIG_DIR] = str(folder)
        return env

    @property
    def _replicas(self) -> int:
        return stream_replicas(self.config.nats.cluster)

    async def _wait_for_jetstream(self, url: str, cluster: NatsCluster | None) -> None:
        """Until JetStream answers (a cluster's meta leader is elected), before any stream is
        made; the run fails naming the nodes' states when it does not in JETSTREAM_WAIT_S."""
        async with Bus.connect(url, name="rlfleet-launcher") as bus:
            try:
                await bus.wait_for_jetstream(JETSTREAM_WAIT_S)
            except Unavailable as exc:
                nodes = f"; {cluster.describe()}" if cluster is not None else ""
                raise Unavailable(f"{exc.message}{nodes}") from exc

    async def _supervise_nats(self, nats: EmbeddedNats) -> None:
        """Restart an embedded nats-server when it dies, on the same ports and store dir: the
        clients (which reconnect forever, to any node of a cluster) find it again with the
        streams and consumers of the run, and a cluster node rejoins its peers. After
        ``nats.restarts`` restarts of this server a further exit fails the run."""
        limit = self.config.nats.restarts
        restarts = 0
        label = nats.label
        while not self._stopping:
            while nats.running:
                await asyncio.sleep(NATS_POLL_S)
            if self._stopping:
                return
            code = nats.returncode
            if restarts >= limit:
                self._finish(
                    1,
                    f"{label} failed ({_describe(code)}) after {restarts} restart(s); "
                    f"last lines of {nats.log_path}:\n{_tail(nats.log_path)}",
                )
                return
            delay = min(self.backoff_s * 2**restarts, MAX_BACKOFF_S)
            restarts += 1
            self.say(
                f"{label} exited ({_describe(code)}); restart {restarts}/{limit} in "
                f"{delay:g}s on {nats.url} (same store)"
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                await nats.start_async()
            except RlfleetError as exc:
                self.say(f"{label} restart {restarts}/{limit} failed: {exc}")
                continue
            self.say(f"{label} up again at {nats.url} (pid {nats.pid})")

    def _finish(self, code: int, message: str) -> None:
        if self._outcome is not None and not self._outcome.done():
            self.say(message)
            self._end_message = message
            self._outcome.set_result(code)

    # --- supervision ---------------------------------------------------------------------------

    def _run_ending(self) -> bool:
        return self._stopping or self._stop.is_set() or bool(self._outcome and self._outcome.done())

    async def _needs_up(self, svc: _Service) -> bool:
        """Wait until every service ``svc`` needs is up (healthy once, or started when it has
        no gRPC); False when the run ends first. A later restart of one is not waited for:
        the services that use it ride it out, as they would in a deployment."""
        waiting = [self._by_name[name] for name in svc.needs]
        if any(not other.ready.is_set() for other in waiting):

            async def all_up() -> None:
                for other in waiting:
                    await other.ready.wait()

            assert self._outcome is not None
            await _first(all_up(), self._outcome, self._stop.wait())
            if self._say_starts and not self._run_ending():
                needs = {s.name: s.needs for s in self._services}
                up = ", ".join(direct_needs(needs, svc.name))  # what the start line named
                self.say(f"starting {svc.name} ({svc.entry.service}): {up} up")
        return not self._run_ending()

    async def _supervise(self, svc: _Service, env: dict[str, str], config_copy: Path) -> None:
        """Spawn at once, start once its needs are up (services/start_gate.py), watch and
        restart one service until it is done or the run ends."""
        while not self._stopping:
            process = await self._spawn(svc, env, config_copy)
            if not await self._let_start(svc, process):
                if process.returncode is None:
                    return  # the run ended first: _stop_one discards the gated process
                # It died at its gate (an import failed, say): a crash like any other.
            elif svc.spec.grpc and not await self._healthy(svc, process):
                if process.returncode is None:
                    return  # _healthy ended the run: never became healthy
            elif not svc.ready.is_set():
                # No gRPC health to wait for (actors, `process` commands): up once started.
                self.say(f"{svc.name} ({svc.entry.service}) started, pid {process.pid}")
                svc.ready.set()
            code = await process.wait()
            svc.exit_codes.append(code)
            if self._stopping:
                return
            if code == EXIT_PERMANENT:
                self._finish(
                    1,
                    f"{svc.name} failed permanently (exit {code}, not restarted): "
                    f"{svc.permanent_reason()}",
                )
                return
            if code == 0:
                svc.ready.set()
                if svc.entry.main:
                    self._finish(0, f"main service {svc.name} finished")
                elif all(s.exit_codes[-1:] == [0] for s in self._services):
                    self._finish(0, "every service finished")
                else:
                    self.say(f"{svc.name} finished (exit 0)")
                return
            _kill_group(process, signal.SIGKILL)  # whatever it started dies with it
            if svc.restarts >= svc.entry.restarts:
                self._finish(
                    1,
                    f"{svc.name} failed ({_describe(code)}) after {svc.restarts} restart(s); "
                    f"last lines of {svc.log_path}:\n{_tail(svc.log_path)}",
                )
                return
            delay = min(self.backoff_s * 2**svc.restarts, MAX_BACKOFF_S)
            self.say(
                f"{svc.name} crashed ({_describe(code)}); "
                f"restart {svc.restarts + 1}/{svc.entry.restarts} in {delay:g}s"
            )
            await asyncio.sleep(delay)

    async def _let_start(self, svc: _Service, process: asyncio.subprocess.Process) -> bool:
        """Open the gate of `process` once `svc`'s needs are up; False when the process exits
        or the run ends first (the gate is then closed, which a waiting service exits on)."""
        gate = svc.gate
        assert gate is not None
        needs_up = asyncio.ensure_future(self._needs_up(svc))
        exited = asyncio.ensure_future(process.wait())
        try:
            await asyncio.wait({needs_up, exited}, return_when=asyncio.FIRST_COMPLETED)
            if needs_up.done() and needs_up.result() and process.returncode is None:
                gate.open()
                svc.gate = None
                return True
            return False
        finally:
            gate.close()
            for task in (needs_up, exited):
                task.cancel()
            await asyncio.gather(needs_up, exited, return_exceptions=True)
            if process.returncode is not None:
                svc.gate = None  # died at its gate: a start that failed, not one never made

    async def _spawn(
        self, svc: _Service, env: dict[str, str], config_copy: Path
    ) -> asyncio.subprocess.Process:
        argv = [sys.executable, "-m", "services.serve", svc.entry.service]
        argv += ["--name", svc.name, "--port", str(svc.port), "--config", str(config_copy)]
        child_env = {
            **env,
            **self._security.env(svc.name),  # its own certificate and NATS user, if any
            reg.ENV_METRICS_PORT: str(svc.metrics_port),
            ENV_EXIT_REASON: str(svc.reason_path),
        }
        gate = StartGate()
        child_env.update(gate.env())
        if svc.entry.threads is not None:
            child_env["OMP_NUM_THREADS"] = str(svc.entry.threads)
        cpus = svc.entry.cpus or self._replica_cpus.get(svc.name)
        if cpus:  # the service pins itself once started up (services/placement.py)
            child_env[ENV_CPUS] = format_cpus(cpus)
        svc.reason_path.unlink(missing_ok=True)  # a reason is about this start only
        svc.starts += 1
        with svc.log_path.open("ab") as log, contextlib.ExitStack() as on_failure:
            on_failure.callback(gate.close)
            # Own session = own process group: a terminal Ctrl-C reaches only the launcher,
            # which stops services in order, and killpg reaches whatever a service started.
            # SIGTERM at the launcher's death (even SIGKILL): the service's graceful stop.
            svc.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                preexec_fn=parent_death_signal(signal.SIGTERM),
                pass_fds=(gate.child_fd,),
            )
            on_failure.pop_all()
            gate.spawned()
            svc.gate = gate
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            header = f"=== {stamp} start {svc.starts} pid {svc.process.pid}: {shlex.join(argv)}\n"
            log.write(header.encode())
        return svc.process

    async def _healthy(self, svc: _Service, process: asyncio.subprocess.Process) -> bool:
        """Poll gRPC health in short slices so a crash during start-up is seen within a second.
        False if the process exited first; on timeout the run fails with the log's tail."""
        deadline = time.monotonic() + self.health_timeout_s
        last = ""
        while process.returncode is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._finish(
                    1,
                    f"{svc.name} not healthy after {self.health_timeout_s:g}s ({last}); "
                    f"last lines of {svc.log_path}:\n{_tail(svc.log_path)}",
                )
                return False
            try:
                await asyncio.to_thread(wait_for_health, svc.address, min(1.0, remaining))
            except TimeoutError as exc:
                last = str(exc)
                continue
            again = " again" if svc.starts > 1 else ""
            self.say(f"{svc.name} ({svc.entry.service}) healthy{again} at {svc.address}")
            announce = svc.spec.announce(svc.entry.settings) if not again else None
            if announce:  # what a user reaches it by (the gateway's OpenAI base URL)
                self.say(announce)
            svc.healthy_start = svc.starts
            svc.ready.set()
            return True
        return False

    async def _stop_all(self) -> None:
        """Stop services in reverse dependency order, one wave at a time (a service only after
        every service that needs it or talks to it), the services of a wave together."""
        needs = {svc.name: svc.needs for svc in self._services}
        for wave in stop_waves(self.config, needs):
            started = [self._by_name[name] for name in wave if name in self._by_name]
            await asyncio.gather(*(self._stop_one(svc) for svc in started))

    async def _stop_one(self, svc: _Service) -> None:
        """SIGTERM, wait the grace, then SIGKILL; a process still at its start gate was never
        started: it is killed and not counted."""
        process = svc.process
        if process is None:
            return
        if svc.gated:
            _kill_group(process, signal.SIGKILL)
            await process.wait()
            svc.gate, svc.process = None, None
            svc.starts -= 1
            return
        if process.returncode is None:
            _kill_group(process, signal.SIGTERM)
            await _first(process.wait(), asyncio.sleep(self.grace_s), self._force.wait())
            if process.returncode is None:
                self.say(f"{svc.name} did not stop in time: SIGKILL")
                _kill_group(process, signal.SIGKILL)
                await process.wait()
            if len(svc.exit_codes) < svc.starts:
                svc.exit_codes.append(process.returncode)  # type: ignore[arg-type]
        _kill_group(process, signal.SIGKILL)  # leftovers of its process group

    # --- producers ----------------------------------------------------------------------------

    def _producer_watch(self) -> ProducerWatch | None:
        """What feeds the main service, when the run has both (launch/producers.py)."""
        main = next((s for s in self._services if s.entry.main), None)
        producers = {
            s.name: noun for s in self._services if (noun := s.spec.produces(s.entry.settings))
        }
        if main is None or not producers:
            return None
        return ProducerWatch(producers, main.name)

    async def _watch_producers(self, watch: ProducerWatch) -> None:
        """Say when nothing can feed the main service any more; end the run or wait for a
        producer to come back, as run.when_producers_gone says."""
        policy = self.config.run.when_producers_gone
        while not self._run_ending():
            await asyncio.sleep(PRODUCERS_POLL_S)
            states = {s["name"]: s["state"] for s in self.service_status()}
            p = self.console.latest.get(watch.consumer)
            progress = f"{p.unit} {compact(p.done)}/{compact(p.total)}".strip() if p else None
            line = watch.check(states, progress, time.monotonic())
            if line is None:
                continue
            if policy == "wait":
                self.say(f"{line}; waiting for one to come back (run.when_producers_gone: wait)")
                continue
            self.say(line)
            self._finish(
                1,
                f"ending the run: {watch.consumer} cannot finish without a producer "
                "(run.when_producers_gone: stop; 'wait' keeps the run up)",
            )
            return

    def _on_status(self, data: bytes, headers: Mapping[str, str] | None) -> None:
        """The run is over (DONE/FAILED): its producers stop as the learner finishes."""
        full_name = (headers or {}).get(TYPE_HEADER)
        if self._producers is None or full_name != events_pb2.RunStatus.DESCRIPTOR.full_name:
            return
        try:
            status = events_pb2.RunStatus.FromString(data)
        except Exception:
            return
        if status.state in RUN_OVER:
            self._producers.run_over = True

    def _on_producer_record(self, data: bytes) -> None:
        if self._producers is None:
            return
        try:
            fields = json_format.MessageToDict(struct_pb2.Struct.FromString(data))
        except Exception:
            return
        record = ProducerReport.from_fields(fields)
        line = self._producers.report(record) if record is not None else None
        if line is not None:
            self.say(line)

    # --- monitor and summary -------------------------------------------------------------------

    async def _monitor(self, url: str) -> None:
        """Hand this run's events to the console; show a held-back progress line when due."""
        try:
            bus = await Bus.connect(url, name="rlfleet-launcher")
        except Exception as exc:
            self.say(f"event monitor off: {exc}")
            return
        console = self.console

        async def on_message(msg: Any) -> None:
            kind = msg.subject.rsplit(".", 1)[-1]
            if kind == PRODUCER_EVENTS:
                self._on_producer_record(msg.data)
                return
            if kind == "status":
                self._on_status(msg.data, msg.headers)
            console.bus_message(msg.subject, msg.data, msg.headers)

        try:
            # Raw subscription: the console decodes any payload type, known or not.
            sub = await bus.nc.subscribe(events_wildcard(self.config.run.name), cb=on_message)
            console.start()
            while not self._monitor_stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._monitor_stop.wait(), TICK_S)
                if console.tick():
                    line = "\n".join(console.progress_lines())
                    self._state.update(figures=console.figures(), line=line)
                self._state.update(services=self.service_status())
            # Unsubscribe, then handle every message the server sent before that (a round trip).
            await sub.drain()  # type: ignore[no-untyped-call]
        finally:
            await bus.close()

    def _summary(self, code: int) -> None:
        lines = [
            ServiceLine(
                svc.name,
                svc.entry.service,
                _describe(svc.exit_codes[-1] if svc.exit_codes else None),
                svc.restarts,
                svc.log_path,
            )
            for svc in self._services
        ]
        self.console.summary(code, self.run_dir, lines)


def _is_terminal(out: IO[str]) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def _kill_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    """Signal the service's whole process group (its pid is the group id)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
