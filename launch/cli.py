"""The ``rlfleet`` command.

The tooling's own subcommands (``up``, ``validate``, ``serve``, ``jobs``, ``health``) are in
``COMMANDS``; every other one comes from the ``rlfleet.commands`` entry-point group (name -> a
`services.commands.Command`), so a service package adds ``play``, ``init-model`` or ``export``
without the tooling importing it. Exit codes: 0 ok, 1 runtime failure, 2 invalid config or usage
(message on stderr naming the key); ``serve`` (services/serve.py) also exits ``EXIT_PERMANENT``
(3) with a one-line reason on stderr when the service fails for good, which the launcher does
not restart. The jobs listing is generated from the settings models.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import yaml

from launch.dashboard.live import dashboard_port_from_env, tensorboard_from_env
from launch.knobs import knob_rows, summary
from launch.launcher import Launcher
from services.commands import COMMANDS_GROUP, Command, Handler, print_table
from services.config import load_run_config
from services.errors import ConfigError, RlfleetError
from services.registry import JOBS_GROUP, entry_point_registry, get_job
from services.serve import add_serve_arguments, serve
from services.server import wait_for_health

__all__ = [
    "COMMANDS",
    "COMMANDS_GROUP",
    "Command",
    "all_commands",
    "command",
    "main",
    "print_table",
]

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


def _up_args(parser: argparse.ArgumentParser) -> None:
    _config_arg(parser)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print every metrics and episode event, not only the progress line "
        "(also: RLFLEET_VERBOSE=1)",
    )
    parser.add_argument(
        "--dashboard-port",
        type=int,
        metavar="PORT",
        help="port of the live dashboard on 127.0.0.1 (default: $RLFLEET_DASHBOARD_PORT, "
        "else 0 = a free port; the URL is printed at start)",
    )
    parser.add_argument("--no-dashboard", action="store_true", help="serve no dashboard")
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="start TensorBoard on the run's tensorboard/ too (also: RLFLEET_TENSORBOARD=1)",
    )


@command("up", "validate a run config, then launch the whole run locally", _up_args)
def _up(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, check_machine=True)
    port = args.dashboard_port
    if port is None and not args.no_dashboard:
        port = dashboard_port_from_env(os.environ)
    return Launcher(
        config,
        args.config,
        verbose=True if args.verbose else None,
        dashboard_port=None if args.no_dashboard else port,
        tensorboard=args.tensorboard or tensorboard_from_env(os.environ),
    ).run()


def _validate_args(parser: argparse.ArgumentParser) -> None:
    _config_arg(parser)
    parser.add_argument(
        "--print",
        action="store_true",
        dest="print_services",
        help="print the services the job expands to, every setting filled in (YAML)",
    )


@command(
    "validate", "validate a run config (structure and every service's settings)", _validate_args
)
def _validate(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, check_machine=True)
    if args.print_services:
        services = [entry.model_dump(mode="json") for entry in config.services]
        print(yaml.safe_dump({"services": services}, sort_keys=False), end="")
        return 0
    print(f"OK: {args.config} (run '{config.run.name}', {len(config.services)} services)")
    return 0


def _jobs_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", nargs="?", help="a job kind: list its knobs")


@command(
    "jobs", "list the job kinds, or one kind's knobs (type, default, bounds, help)", _jobs_args
)
def _jobs(args: argparse.Namespace) -> int:
    if args.kind is None:
        rows = []
        for kind in entry_point_registry(JOBS_GROUP):
            try:
                about = summary(get_job(kind).settings.__doc__)
            except ConfigError as exc:  # one broken plugin must not hide the others
                about = f"(failed to load: {exc})"
            rows.append({"kind": kind, "description": about})
        print_table(rows)
        return 0
    spec = get_job(args.kind)
    print(f"{spec.kind}: {summary(spec.settings.__doc__, first_sentence=False)}")
    print_table(knob_rows(spec.settings))
    return 0


def _health_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", help="host:port")
    parser.add_argument("--service", default="", help="gRPC service name ('' = the server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for SERVING")


@command("health", "exit 0 once a service's gRPC health is SERVING (probes)", _health_args)
def _health(args: argparse.Namespace) -> int:
    try:
        wait_for_health(args.address, args.timeout, args.service)
    except TimeoutError as exc:
        print(f"rlfleet: {exc}", file=sys.stderr)
        return 1
    print(f"{args.address}: SERVING")
    return 0


def _studio_args(parser: argparse.ArgumentParser) -> None:
    from launch.studio.command import add_studio_arguments

    add_studio_arguments(parser)


@command(
    "studio", "a local web app: start, watch, compare, play, export and serve runs", _studio_args
)
def _studio(args: argparse.Namespace) -> int:
    from launch.studio.command import run_studio

    return run_studio(args)


@command("serve", "run one service (what containers run)", add_serve_arguments)
def _serve(args: argparse.Namespace) -> int:
    return serve(args.kind, config=args.config, name=args.name, host=args.host, port=args.port)


def all_commands() -> dict[str, Command]:
    """The runtime's commands, then the installed ``rlfleet.commands`` in name order. A plugin
    reusing a runtime command's name, or registering something that is not a `Command`, is a
    ConfigError naming its entry point."""
    commands = dict(COMMANDS)
    plugins = entry_point_registry(COMMANDS_GROUP)
    for name in plugins:
        if name in commands:
            raise ConfigError(
                f"command '{name}' ({plugins.target(name)}) clashes with a built-in command"
            )
        try:
            cmd = plugins[name]
        except Exception as exc:  # one broken plugin must not take every other command down
            commands[name] = _unloadable(name, plugins.target(name), exc)
            continue
        if not isinstance(cmd, Command):
            raise ConfigError(f"entry point '{name}' ({plugins.target(name)}) is not a Command")
        commands[name] = cmd
    return commands


def _unloadable(name: str, target: str, exc: Exception) -> Command:
    """A command whose entry point fails to import: listed, and failing with the reason."""
    reason = (
        str(exc)
        if isinstance(exc, ConfigError)
        else (f"command '{name}' ({target}) failed to load: {type(exc).__name__}: {exc}")
    )

    def fail(args: argparse.Namespace) -> int:
        raise ConfigError(reason)

    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    return Command(f"(failed to load: {type(exc).__name__})", arguments, fail)


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
    except BrokenPipeError:  # `rlfleet jobs ppo | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
