"""``rlfleet studio``: serve the studio until Ctrl-C (runs it started go on)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import socket
from pathlib import Path

from services.errors import ConfigError

__all__ = ["ENV_STUDIO_TOKEN", "add_studio_arguments", "run_studio"]

ENV_STUDIO_TOKEN = "RLFLEET_STUDIO_TOKEN"
DEFAULT_PORT = 8265


def add_studio_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", type=Path, default=Path("."),
        help="the folder whose runs/ the studio manages; runs start with it as their current "
        "directory, as `rlfleet up` typed there (default: here)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: a free one)")
    parser.add_argument(
        "--token",
        help=f"require this token (default: ${ENV_STUDIO_TOKEN}; on an address other than "
        "loopback a token is required, and one is made up and printed when none is given)",
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_studio(args: argparse.Namespace) -> int:
    import uvicorn

    from launch.studio.app import create_studio_app
    from launch.studio.book import RunBook

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: not a port number (0-65535)")
    workdir = args.workdir
    if not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir}: not a folder")
    token = args.token or os.environ.get(ENV_STUDIO_TOKEN) or None
    if token is None and not _loopback(args.host):
        token = secrets.token_urlsafe(24)
    book = RunBook(workdir)
    app = create_studio_app(book, token=token)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(128)  # connections wait for the server from now on, not refused
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
        ) from None
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    query = f"?token={token}" if token else ""
    print(f"rlfleet studio: runs in {book.root}", flush=True)
    print(f"rlfleet studio at http://{shown}:{port}/{query}", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])  # until Ctrl-C or SIGTERM
    return 0
