"""The ``rlfleet`` command.

The runtime's own subcommands (``up``, ``validate``, ``serve``) are in ``COMMANDS``; every other
one comes from the ``rlfleet.commands`` entry-point group (name -> a `Command`), so a service
package adds ``play``, ``init-model`` or ``export`` without the runtime importing it. A command's
module must be cheap to import: the parser is built from every command at start, and heavy
imports (torch, vLLM) belong inside the handler. Exit codes: 0 ok, 1 runtime failure, 2 invalid
config or usage (message on stderr naming the key).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from services.errors import ConfigError, RlfleetError

__all__ = [
    "COMMANDS",
    "COMMANDS_GROUP",
    "Command",
    "all_commands",
    "command",
    "main",
    "print_table",
]

COMMANDS_GROUP = "rlfleet.commands"

log = logging.getLogger("rlfleet")

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """One subcommand: its one-line help, its argument setup and its handler (exit code)."""

    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    handler: Handler


COMMANDS: dict[str, Command] = {}


def command(
    name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
) -> Callable[[Handler], Handler]:
    """Register a subcommand."""

    def add(handler: Handler) -> Handler:
        COMMANDS[name] = Command(help, arguments, handler)
        return handler

    return add


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML file")


@command("up", "validate a run config, then launch the whole run locally", _config_arg)
def _up(args: argparse.Namespace) -> int:
    from services.config import load_run_config
    from services.launcher import Launcher

    config = load_run_config(args.config)
    return Launcher(config, args.config).run()


@command("validate", "validate a run config (structure and every service's settings)", _config_arg)
def _validate(args: argparse.Namespace) -> int:
    from services.config import load_run_config

    config = load_run_config(args.config)
    print(f"OK: {args.config} (run '{config.run.name}', {len(config.services)} services)")
    return 0


def _serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", help="service kind (an `rlfleet.services` entry point)")
    parser.add_argument("--config", help="run config to take settings from ($RLFLEET_RUN_CONFIG)")
    parser.add_argument("--name", help="instance name (default: the kind)")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind host")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free)")


@command("serve", "run one service (what the launcher and containers run)", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    from services.config import load_service_settings
    from services.registry import ServiceContext, get_service
    from services.telemetry import setup_tracing, start_metrics_server

    spec = get_service(args.kind)
    config = args.config or os.environ.get("RLFLEET_RUN_CONFIG") or None
    settings = load_service_settings(args.kind, config, args.name, os.environ)
    ctx = ServiceContext.from_environment(
        spec.kind, settings, name=args.name, host=args.host, port=args.port
    )
    logging.basicConfig(
        level=os.environ.get("RLFLEET_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s {ctx.name} %(name)s: %(message)s",
    )
    setup_tracing(ctx.name, os.environ.get("RLFLEET_TRACING", "none"))
    if ctx.metrics_port is not None:
        start_metrics_server(ctx.metrics_port)

    async def serve() -> None:
        from services.server import install_signal_handlers

        install_signal_handlers(ctx.stop_event)
        watch = asyncio.create_task(_stop_when_orphaned(ctx.stop_event))
        try:
            await spec.main(ctx)
        finally:
            watch.cancel()

    try:
        asyncio.run(serve())
    except Exception:
        log.exception("%s (%s) failed", ctx.name, spec.kind)
        return 1
    return 0


async def _stop_when_orphaned(stop_event: asyncio.Event) -> None:
    """Stop gracefully if the launcher that started us dies without stopping us (SIGKILL,
    OOM): services run in their own process group, so nothing else would end them."""
    launcher = os.environ.get("RLFLEET_LAUNCHER_PID")
    if not launcher or not launcher.isdigit():
        return
    while os.getppid() == int(launcher):
        await asyncio.sleep(1.0)
    log.warning("launcher (pid %s) is gone: stopping", launcher)
    stop_event.set()


def print_table(rows: Iterable[Any]) -> None:
    """Print strings one per line, or mappings/objects/protobuf messages as aligned columns."""
    records = []
    for row in rows:
        if isinstance(row, str):
            row = {"id": row}
        elif hasattr(row, "ListFields"):
            row = {d.name: v for d, v in row.ListFields()}
        elif not isinstance(row, dict):
            row = dict(vars(row))
        records.append({k: str(v) for k, v in row.items()})
    if not records:
        print("(none)")
        return
    columns = list(dict.fromkeys(k for r in records for k in r))
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in records)) for c in columns}
    for line in [dict(zip(columns, columns, strict=True)), *records]:
        print("  ".join(line.get(c, "").ljust(widths[c]) for c in columns).rstrip())


def all_commands() -> dict[str, Command]:
    """The runtime's commands, then the installed ``rlfleet.commands`` in name order. A plugin
    reusing a runtime command's name, or registering something that is not a `Command`, is a
    ConfigError naming its entry point."""
    from services.registry import entry_point_registry

    commands = dict(COMMANDS)
    plugins = entry_point_registry(COMMANDS_GROUP)
    for name in plugins:
        if name in commands:
            raise ConfigError(
                f"command '{name}' ({plugins.target(name)}) clashes with a built-in command"
            )
        cmd = plugins[name]
        if not isinstance(cmd, Command):
            raise ConfigError(f"entry point '{name}' ({plugins.target(name)}) is not a Command")
        commands[name] = cmd
    return commands


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlfleet", description="Distributed RL training on independently scaled services."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in commands.items():
        cmd.arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        commands = all_commands()
    except ConfigError as exc:
        print(f"rlfleet: error: {exc}", file=sys.stderr)
        return 2
    args = build_parser(commands).parse_args(argv)
    try:
        return commands[args.command].handler(args)
    except ConfigError as exc:
        print(f"rlfleet: error: {exc}", file=sys.stderr)
        return 2
    except RlfleetError as exc:  # e.g. a server that is unavailable: a message, not a traceback
        print(f"rlfleet: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy: command plugins build services.cli.Command.
    from services import cli

    sys.exit(cli.main())
