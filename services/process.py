"""The ``process`` service kind: an external command (a game binary, ``node snake.js``) that the
launcher supervises like any service, so one ``rlfleet up`` runs a game and its trainer.

Settings: ``command`` (argv), ``cwd`` (relative to the run file's folder, which is also the
default), ``env`` (added to the service's environment). ``{address:<service>}``, ``{run}`` and
``{run_dir}`` in ``command`` and ``env`` values become the service's ``host:port``, the run name
and the run directory; a name that is no service of the run (or one without an address) is a
config error naming the key.

``rlfleet serve process`` is a thin supervisor: it waits until the services the command refers
to report healthy, starts the command in a process group of its own with a parent-death signal,
and exits with it (0 when it exits 0, else 1, which the launcher restarts with its usual backoff
and limit). On stop it sends SIGTERM to the command's group, SIGKILL after ``stop_grace_s``
(shorter than the launcher's grace, so the group is gone before this process is). If this
process dies first, even by SIGKILL, the command gets SIGTERM from the kernel. There is no gRPC
port: the launcher counts the service up once it started. Output goes to the service's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from services.bus.nats_server import parent_death_signal
from services.config import StrictModel
from services.errors import ConfigError
from services.placement import pin_to_assigned_cpus
from services.registry import ServiceContext, ServiceSpec
from services.server import wait_for_health

__all__ = [
    "PLACEHOLDERS",
    "SPEC",
    "ProcessSettings",
    "check_command",
    "substitute",
]

log = logging.getLogger(__name__)

# `{name}` or `{name:arg}` with a lowercase name; other braces (JSON, shell) are left alone.
_PLACEHOLDER = re.compile(r"\{([a-z_]+)(?::([^{}]*))?\}")
PLACEHOLDERS = "{address:<service>}, {run}, {run_dir}"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
Loc = tuple[str | int, ...]


def _placeholders(text: str) -> Iterator[tuple[str, str | None, str]]:
    """(name, argument, the whole placeholder) for each placeholder in ``text``."""
    for match in _PLACEHOLDER.finditer(text):
        yield match.group(1), match.group(2), match.group(0)


def _check_placeholders(text: str) -> str:
    for name, arg, whole in _placeholders(text):
        if name == "address" and arg:
            continue
        if name in ("run", "run_dir") and arg is None:
            continue
        raise ValueError(f"unknown placeholder '{whole}' (known: {PLACEHOLDERS})")
    return text


class ProcessSettings(StrictModel):
    """Settings of the ``process`` kind (an external command the launcher supervises)."""

    command: list[str] = Field(min_length=1)  # argv; argv[0] on PATH or a path (from cwd)
    cwd: str | None = None  # relative to the run file's folder (the default)
    env: dict[str, str] = Field(default_factory=dict)  # added to the inherited environment
    stop_grace_s: float = Field(default=5.0, gt=0)  # SIGTERM to SIGKILL of the command's group
    ready_timeout_s: float = Field(default=300.0, gt=0)  # wait for referenced services

    @field_validator("command")
    @classmethod
    def _command(cls, argv: list[str]) -> list[str]:
        if not argv[0].strip():
            raise ValueError("command[0] (the program) must not be empty")
        for arg in argv:
            _check_placeholders(arg)
        return argv

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, env: Any) -> Any:
        if not isinstance(env, Mapping):
            return env  # pydantic reports the type
        out = {}
        for key, value in env.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise ValueError(f"env: {key!r} is not a valid environment variable name")
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise ValueError(f"env.{key}: must be a string or a number, got {value!r}")
            out[key] = _check_placeholders(str(value))  # YAML numbers (BOARDS: 8) are fine
        return out

    def address_refs(self) -> Iterator[tuple[Loc, str]]:
        """Service names in ``{address:...}`` placeholders, with where they are (the run config
        checks each is a service of the run that has an address)."""
        texts: list[tuple[Loc, str]] = [(("command", i), a) for i, a in enumerate(self.command)]
        texts += [(("env", k), v) for k, v in self.env.items()]
        for loc, text in texts:
            for name, arg, _ in _placeholders(text):
                if name == "address" and arg:
                    yield loc, arg


def substitute(text: str, ctx: ServiceContext[Any]) -> str:
    """``text`` with its placeholders replaced from the service's context."""

    def one(match: re.Match[str]) -> str:
        name, arg = match.group(1), match.group(2)
        if name == "address" and arg:
            return ctx.resolve(arg)
        if name == "run" and arg is None:
            return ctx.run_name
        if name == "run_dir" and arg is None:
            return str(ctx.run_dir)
        raise ConfigError(f"unknown placeholder '{match.group(0)}' (known: {PLACEHOLDERS})")

    return _PLACEHOLDER.sub(one, text)


def working_dir(settings: ProcessSettings, config_dir: Path) -> Path:
    """Where the command runs: ``cwd`` relative to the run file's folder, or that folder."""
    return (config_dir / settings.cwd) if settings.cwd else config_dir


def check_command(settings: ProcessSettings, config_dir: Path) -> list[tuple[Loc, str]]:
    """Problems that would stop the command from starting: a missing working directory, or a
    program that is neither on PATH nor an executable file. (Arguments are the program's
    business; a program named by a placeholder is checked when it starts.)"""
    cwd = working_dir(settings, config_dir)
    if not cwd.is_dir():
        return [(("cwd",), f"working directory {cwd} does not exist")]
    program = settings.command[0]
    if any(True for _ in _placeholders(program)):
        return []
    if "/" in program:
        path = cwd / program
        if not path.is_file():
            return [(("command", 0), f"program {program!r} not found (looked at {path})")]
        if not os.access(path, os.X_OK):
            return [(("command", 0), f"program {path} is not executable (chmod +x it)")]
        return []
    search = settings.env.get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(program, path=search) is None:
        return [(("command", 0), f"program {program!r} is not on PATH (install it or give a path)")]
    return []


# --- running it --------------------------------------------------------------------------------


async def _wait_for_peers(ctx: ServiceContext[ProcessSettings]) -> bool:
    """Wait until every service named by ``{address:...}`` answers SERVING; False if stopped.
    The launcher starts those first anyway; this also holds outside it (containers)."""
    deadline = time.monotonic() + ctx.settings.ready_timeout_s
    for _, name in ctx.settings.address_refs():
        address = ctx.resolve(name)
        while not ctx.stop_event.is_set():
            try:
                await asyncio.to_thread(wait_for_health, address, 1.0)
                break
            except TimeoutError as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} ({address}) not healthy: {exc}") from None
    return not ctx.stop_event.is_set()


def _key(loc: Loc) -> str:
    """``command[0]``, ``cwd``: a key path as config errors write it."""
    return "".join(
        f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc)
    )


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"exit {code}"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def main(ctx: ServiceContext[ProcessSettings]) -> None:
    """Run the command until it exits (0: done; else an error, so the launcher restarts it) or
    the service is stopped."""
    settings = ctx.settings
    problems = check_command(settings, ctx.config_dir)
    if problems:
        raise ConfigError("; ".join(f"{_key(loc)}: {msg}" for loc, msg in problems))
    argv = [substitute(arg, ctx) for arg in settings.command]
    env = {**os.environ, **{k: substitute(v, ctx) for k, v in settings.env.items()}}
    cwd = working_dir(settings, ctx.config_dir)
    if not await _wait_for_peers(ctx):
        return
    pin_to_assigned_cpus()  # the command inherits them
    # Own process group: a stop reaches whatever the command starts. Parent-death signal: the
    # command ends when this supervisor dies, however it dies.
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGTERM),
        )
    except OSError as exc:  # not a program (exec format error), no permission: no restart heals
        raise ConfigError(f"command[0]: cannot start {argv[0]!r}: {exc.strerror or exc}") from None
    log.info("%s: started pid %d in %s: %s", ctx.name, process.pid, cwd, shlex.join(argv))
    exited = asyncio.ensure_future(process.wait())
    stopped = asyncio.ensure_future(ctx.stop_event.wait())
    try:
        await asyncio.wait({exited, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():
            _signal_group(process.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), settings.stop_grace_s)
    finally:
        _signal_group(process.pid, signal.SIGKILL)  # the command, or what it left behind
        code = await exited
        stopped.cancel()
    log.info("%s: pid %d ended (%s)", ctx.name, process.pid, _describe(code))
    if code != 0 and not ctx.stop_event.is_set():
        raise RuntimeError(f"{ctx.name}: {shlex.join(argv)} failed ({_describe(code)})")


SPEC = ServiceSpec(
    kind="process",
    settings=ProcessSettings,
    main=main,
    grpc=False,
    check=check_command,
    uses_bus=lambda s: False,  # the game's own process reaches only its env server
)
