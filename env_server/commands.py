"""env_server's `rlfleet` subcommands (entry points in ``rlfleet.commands``): ``envs`` and
``play``. Cheap to import: the handlers load gymnasium, gRPC clients or torch when they run."""

from __future__ import annotations

import argparse
import asyncio

from services.commands import Command, print_table


def _envs_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="ask this env server (host:port) instead of this machine")


def _envs(args: argparse.Namespace) -> int:
    if args.server:
        from clients.env import list_envs

        rows = asyncio.run(list_envs(args.server))
    else:
        from env_server.registry import list_local_envs

        rows = list_local_envs()
    print_table(rows)
    return 0


def _play_args(parser: argparse.ArgumentParser) -> None:
    from env_server.play import add_arguments  # stdlib-only at import

    add_arguments(parser)


def _play(args: argparse.Namespace) -> int:
    from env_server.play import main

    return main(args)


ENVS = Command("list environments (registered locally, or served by --server)", _envs_args, _envs)
PLAY = Command("run a trained policy locally: episode returns, optional video", _play_args, _play)
