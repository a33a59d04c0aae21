"""Running one service in this process: what ``rlfleet serve KIND`` does, in a container or under
``rlfleet up``.

`serve` loads the kind's settings (run config and environment overrides), builds its
`ServiceContext`, runs the kind's preload, waits at the start gate when a launcher holds one
(services/start_gate.py), starts tracing and the metrics endpoint, then runs the kind's main
until it returns or a signal stops it. It returns the process's exit code: 0 when the service
finished, 1 for a failure a restart may heal, ``EXIT_PERMANENT`` (3) with a one-line reason on
stderr (and in ``$RLFLEET_EXIT_REASON_FILE``) for one it cannot (a ConfigError or
InvalidArgument: restarting it would fail the same way), which a supervisor does not restart.

A served process never outlives its work or its launcher: once the service's main returned, a
teardown that hangs is cut short (`EXIT_GRACE_S`), and a service whose launcher died stops
gracefully, then exits at once `ORPHAN_GRACE_S` later.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
import threading
from collections.abc import Mapping

from services import registry
from services.config import load_service_settings
from services.errors import EXIT_PERMANENT, is_permanent
from services.server import install_signal_handlers
from services.start_gate import wait_at_gate
from services.telemetry import setup_tracing, start_metrics_server

__all__ = [
    "ENV_EXIT_REASON",
    "EXIT_GRACE_S",
    "ORPHAN_GRACE_S",
    "add_serve_arguments",
    "main",
    "serve",
]

# Where `serve` writes the one-line reason of a permanent failure (set by the launcher, which
# quotes it); the same line always goes to stderr too.
ENV_EXIT_REASON = "RLFLEET_EXIT_REASON_FILE"
ORPHAN_GRACE_S = 15.0  # an orphaned service that has not stopped by then exits at once
EXIT_GRACE_S = 30.0  # a service whose main returned but whose process has not ended by then

log = logging.getLogger("rlfleet")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``rlfleet serve`` and ``python -m services.serve``."""
    parser.add_argument("kind", help="service kind (an `rlfleet.services` entry point)")
    parser.add_argument("--config", help="run config to take settings from ($RLFLEET_RUN_CONFIG)")
    parser.add_argument("--name", help="instance name (default: the kind)")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind host")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free)")


def main(argv: list[str] | None = None) -> int:
    """``python -m services.serve KIND ...``: what the launcher spawns, so that a service's
    process never imports the tooling."""
    parser = argparse.ArgumentParser(prog="python -m services.serve", description=main.__doc__)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    return serve(args.kind, config=args.config, name=args.name, host=args.host, port=args.port)


def serve(
    kind: str,
    *,
    config: str | None = None,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> int:
    """Run one service of ``kind`` until it finishes or is stopped; the process exit code.
    ``config``: the run config to take settings from (else ``$RLFLEET_RUN_CONFIG``);
    ``name``: the instance name (default: the kind); ``port`` 0: any free port."""
    try:
        return _serve_until_done(kind, config, name, host, port)
    except BaseException as exc:
        cause = _permanent_cause(exc)
        if cause is None:
            raise
        return _fail_permanently(kind, name, cause)


def _serve_until_done(kind: str, config: str | None, name: str | None, host: str, port: int) -> int:
    spec = registry.get_service(kind)
    config = config or os.environ.get(registry.ENV_RUN_CONFIG) or None
    settings = load_service_settings(kind, config, name, os.environ)
    ctx = registry.ServiceContext.from_environment(
        spec.kind, settings, name=name, host=host, port=port, config=config
    )
    logging.basicConfig(
        level=os.environ.get("RLFLEET_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s {ctx.name} %(name)s: %(message)s",
    )
    spec.preload(settings)
    if not wait_at_gate(os.environ):
        return 0  # the run ended before this service's needs were up: it never started
    setup_tracing(ctx.name, os.environ.get("RLFLEET_TRACING", "none"))
    if ctx.metrics_port is not None:
        # On the gRPC bind host: loopback locally, all interfaces in a container (--host
        # 0.0.0.0), where Prometheus and the probes reach it from outside the process's host.
        start_metrics_server(ctx.metrics_port, host=ctx.host)

    watchdog: list[threading.Timer] = []

    async def run() -> None:
        install_signal_handlers(ctx.stop_event)
        watch = asyncio.create_task(_stop_when_orphaned(ctx.stop_event, os.environ))
        code = 1
        try:
            await spec.main(ctx)
            code = 0
        finally:
            watch.cancel()
            watchdog.append(_exit_if_stuck(ctx.name, code))

    try:
        asyncio.run(run())
    except Exception as exc:
        if _permanent_cause(exc) is not None:
            raise  # serve reports it in one line
        log.exception("%s (%s) failed", ctx.name, spec.kind)
        return 1
    finally:
        for timer in watchdog:  # the teardown finished: nothing to force
            timer.cancel()
    return 0


def _permanent_cause(exc: BaseException) -> BaseException | None:
    """The error that makes ``exc`` permanent (itself, or the leaf of an exception group whose
    leaves are all permanent), or None for a failure a restart may heal."""
    if is_permanent(exc):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(is_permanent)
        if match is not None and rest is None:
            leaf: BaseException = match
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            return leaf
    return None


def _fail_permanently(kind: str, name: str | None, exc: BaseException) -> int:
    """One line on stderr (and in $RLFLEET_EXIT_REASON_FILE), no traceback: EXIT_PERMANENT."""
    message = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    reason = f"{name or kind} ({kind}): {type(exc).__name__}: {message}"
    print(f"rlfleet: permanent failure: {reason}", file=sys.stderr, flush=True)
    path = os.environ.get(ENV_EXIT_REASON)
    if path:
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as out:
            out.write(reason + "\n")
    return EXIT_PERMANENT


def _exit_if_stuck(name: str, code: int) -> threading.Timer:
    """Once the service's work is over, its process must end: if the teardown after it (tasks
    being cancelled, executor threads being joined by asyncio.run) has not finished
    ``EXIT_GRACE_S`` later, print every thread's stack (to find what hung) and exit with the
    service's own code, so a run is never held up by a service that is done. The caller
    cancels the returned timer once asyncio.run has returned."""

    def force() -> None:
        log.error("%s: still not exited %gs after its work ended; stacks:", name, EXIT_GRACE_S)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(EXIT_GRACE_S, force)
    timer.daemon = True
    timer.start()
    return timer


async def _stop_when_orphaned(stop_event: asyncio.Event, environ: Mapping[str, str]) -> None:
    """Stop gracefully if the launcher that started us dies without stopping us (SIGKILL,
    OOM): services run in their own process group, so nothing else would end them. (The
    launcher also asks the kernel for a SIGTERM at its death, PR_SET_PDEATHSIG, which lands on
    the same graceful stop.) A service that has not stopped ``ORPHAN_GRACE_S`` later (its bus
    is gone with the launcher, say) exits at once: an orphan must never linger."""
    launcher = environ.get(registry.ENV_LAUNCHER_PID)
    if not launcher or not launcher.isdigit():
        return
    while os.getppid() == int(launcher) and not stop_event.is_set():
        await asyncio.sleep(1.0)
    if not stop_event.is_set():
        log.warning("launcher (pid %s) is gone: stopping", launcher)
        stop_event.set()
    while os.getppid() == int(launcher):
        await asyncio.sleep(1.0)  # a normal stop, the launcher still there: nothing to force
    await asyncio.sleep(ORPHAN_GRACE_S)
    log.warning("still running %gs after the launcher died: exiting", ORPHAN_GRACE_S)
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
