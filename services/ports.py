"""Free loopback ports for the services of a local run.

The launcher must know every service's address before it starts any of them (a service's
settings may name a peer that starts later), so it asks the kernel for ports up front instead
of letting each server bind port 0.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack

__all__ = ["free_port", "free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now.

    All sockets stay bound until every port is picked, so the ports are distinct. Another
    process can still take one before the service binds it; on a loopback-only developer
    machine that window (well under a second) is an accepted risk.
    """
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host``."""
    return free_ports(1, host)[0]
