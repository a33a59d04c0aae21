"""What ``rlfleet up`` serves to watch a run: the dashboard, and TensorBoard when asked.

`LiveView` is all the launcher knows of them: ``start`` once the run is set up (it prints the
URLs), ``stop`` after the services have stopped. The dashboard runs in the launcher process
(launch.dashboard.server); TensorBoard is a child process on the run's ``tensorboard/``
directory, supervised like a service but never fatal to the run: it is restarted a few times
with backoff when it exits, then given up with one line. It runs in its own process group, gets
SIGTERM when the launcher dies (PR_SET_PDEATHSIG, even on SIGKILL), and is stopped with the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from services.bus.nats_server import parent_death_signal
from services.errors import ConfigError
from services.ports import free_port

__all__ = [
    "ENV_DASHBOARD_PORT",
    "ENV_TENSORBOARD",
    "LiveView",
    "dashboard_port_from_env",
    "tensorboard_from_env",
]

ENV_DASHBOARD_PORT = "RLFLEET_DASHBOARD_PORT"  # the dashboard's port (0: a free one)
ENV_TENSORBOARD = "RLFLEET_TENSORBOARD"  # 1: start TensorBoard too (rlfleet up --tensorboard)
HOST = "127.0.0.1"
TENSORBOARD_RESTARTS = 3
TENSORBOARD_BACKOFF_S = 1.0
TENSORBOARD_GRACE_S = 5.0


def dashboard_port_from_env(environ: Mapping[str, str]) -> int:
    """``$RLFLEET_DASHBOARD_PORT`` (default 0, a free port); ConfigError when not a port."""
    raw = environ.get(ENV_DASHBOARD_PORT, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > 65535:
        raise ConfigError(f"{ENV_DASHBOARD_PORT}={raw!r}: not a port number (0-65535)")
    return int(raw)


def tensorboard_from_env(environ: Mapping[str, str]) -> bool:
    """``$RLFLEET_TENSORBOARD`` set to 1/true/yes/on."""
    return environ.get(ENV_TENSORBOARD, "").strip().lower() in ("1", "true", "yes", "on")


class LiveView:
    """The dashboard (on ``dashboard_port``; None: off) and TensorBoard (``tensorboard``) of
    the run in ``run_dir``; ``status`` is the launcher's read-only view of its services."""

    def __init__(
        self,
        run_dir: Path,
        *,
        dashboard_port: int | None,
        tensorboard: bool,
        status: Callable[[], list[dict[str, Any]]],
        say: Callable[[str], None],
        environ: Mapping[str, str],
    ) -> None:
        if tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                "--tensorboard: the tensorboard package is not installed "
                "(pip install tensorboard, or rlfleet[learner])"
            )
        if dashboard_port is not None and not 0 <= dashboard_port <= 65535:
            raise ConfigError(f"dashboard port {dashboard_port}: not a port number (0-65535)")
        self.run_dir, self.dashboard_port, self.tensorboard = run_dir, dashboard_port, tensorboard
        self.status, self.say, self.environ = status, say, environ
        self._server: Any = None  # launch.dashboard.server.DashboardServer
        self._tensorboard: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.dashboard_port is not None:
            await self._start_dashboard(self.dashboard_port)
        if self.tensorboard:
            logdir = self.run_dir / "tensorboard"
            log = self.run_dir / "logs" / "tensorboard.log"
            self._tensorboard = asyncio.create_task(self._run_tensorboard(logdir, log))

    async def _start_dashboard(self, port: int) -> None:
        # Imported here: a run without the dashboard never loads the web stack.
        from launch.dashboard.app import create_app
        from launch.dashboard.metrics import Runs
        from launch.dashboard.server import DashboardServer

        app = create_app(Runs(self.run_dir.parent, current=self.run_dir), self.status)
        server = DashboardServer(app, HOST, port)
        try:
            url = await asyncio.to_thread(server.start)
        except OSError as exc:  # the port is taken: the run matters more than its page
            self.say(f"dashboard off: cannot listen on {HOST}:{port}: {exc.strerror or exc}")
            return
        except RuntimeError as exc:
            self.say(f"dashboard off: {exc}")
            return
        self._server = server
        self.say(f"dashboard at {url}")

    async def stop(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.cancel()
            await asyncio.gather(self._tensorboard, return_exceptions=True)
            self._tensorboard = None
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None

    async def _run_tensorboard(self, logdir: Path, log_path: Path) -> None:
        """TensorBoard until cancelled, restarted with backoff up to TENSORBOARD_RESTARTS."""
        port = free_port(HOST)
        argv = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
        argv += ["--host", HOST, "--port", str(port)]
        env = {**self.environ, "OMP_NUM_THREADS": self.environ.get("OMP_NUM_THREADS", "1")}
        self.say(f"TensorBoard at http://{HOST}:{port}/ (log {log_path})")
        restarts = 0
        while True:
            with log_path.open("ab") as log:
                # Spawned from the loop's thread: the parent-death signal follows that thread.
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=parent_death_signal(signal.SIGTERM),
                )
            try:
                code = await process.wait()
            except asyncio.CancelledError:
                await _stop_group(process)
                raise
            if restarts >= TENSORBOARD_RESTARTS:
                self.say(
                    f"TensorBoard failed (exit {code}) after {restarts} restart(s); see {log_path}"
                )
                return
            restarts += 1
            delay = TENSORBOARD_BACKOFF_S * 2 ** (restarts - 1)
            limit = TENSORBOARD_RESTARTS
            self.say(f"TensorBoard exited (exit {code}); restart {restarts}/{limit} in {delay:g}s")
            await asyncio.sleep(delay)


async def _stop_group(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to the process group, SIGKILL after the grace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), TENSORBOARD_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()
