"""Warm starts: `rlfleet up` starts a service's process at once and lets it begin once what it
needs is up.

Most of a Python service's start-up is imports (torch, DeepSpeed, torch._dynamo), and none of
them depends on another service. So the launcher spawns
every service at the start of the run with the read end of a pipe, the gate; `serve` loads the
service, runs its spec's `preload` (the imports its start makes), then blocks on the gate. The
launcher writes one byte once the service's needs are up (services/start_order.py), and the
service starts exactly as it would have started then: what it does with its peers (connections,
sessions, the first weights) happens in the same order. Closing the gate without a byte (the
run ended first) makes the service exit quietly. A service started without a gate (a
container, `serve` by hand) does not wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import MutableMapping

__all__ = ["ENV_START_GATE", "StartGate", "wait_at_gate"]

ENV_START_GATE = "RLFLEET_START_GATE"  # the gate's file descriptor in a service's process

log = logging.getLogger(__name__)


class StartGate:
    """The launcher's end of one service start's gate."""

    def __init__(self) -> None:
        self.child_fd, self._write_fd = os.pipe()

    def env(self) -> dict[str, str]:
        """What the service's environment names the gate by (pass `child_fd` to it too)."""
        return {ENV_START_GATE: str(self.child_fd)}

    def spawned(self) -> None:
        """The service's process has its copy of the read end: drop the launcher's."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def open(self) -> None:
        """Let the service start (once; a process that has died already is no error)."""
        self.spawned()
        if self._write_fd >= 0:
            with contextlib.suppress(BrokenPipeError):  # it died already
                os.write(self._write_fd, b"\x01")
            self.close()

    def close(self) -> None:
        """Without `open` first: the service exits without starting."""
        self.spawned()
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1

    @property
    def opened_or_closed(self) -> bool:
        return self._write_fd < 0


def wait_at_gate(environ: MutableMapping[str, str]) -> bool:
    """Block until the launcher opens this process's gate; True at once without one. False when
    the gate was closed instead: the run ended before the service's needs were up. The gate
    leaves `environ`: a process this service starts has no such descriptor."""
    value = environ.pop(ENV_START_GATE, None)
    if not value:
        return True
    fd = int(value)
    started = time.monotonic()
    try:
        opened = os.read(fd, 1) == b"\x01"
    finally:
        os.close(fd)
    if opened:
        log.info("started after %.1f s at the start gate", time.monotonic() - started)
    return opened
