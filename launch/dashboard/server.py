"""The dashboard's HTTP server: uvicorn on its own thread of the launcher process.

Its own thread and event loop, so reading a large earlier run's metrics never delays the
launcher's supervision, and the launcher's signal handling stays its own (uvicorn installs
signal handlers only on the main thread). The socket is bound before the thread starts, so a
busy port is an OSError at ``start`` and port 0 gives the real port for the printed URL.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

__all__ = ["DashboardServer"]

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class DashboardServer:
    """Serves ``app`` on ``host:port`` (0: a free port) until ``stop``."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self) -> str:
        """Bind, serve, and return the URL once the server accepts connections."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self._sock, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,  # leave the process's logging alone: warnings reach stderr
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        server = self._server = uvicorn.Server(config)
        thread = self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="rlfleet-dashboard", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the dashboard server did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None
