"""Free loopback ports for the services of a local run.

The launcher must know every service's address before it starts any of them (a service's
settings may name a peer that starts later), so it picks ports up front instead of letting each
server bind port 0. A picked port stays unbound until its service binds it, seconds later when
the service's imports run first (services/start_gate.py). So the ports come from outside the
kernel's ephemeral range (`net.ipv4.ip_local_port_range`): that is where the kernel puts whatever
binds port 0 meanwhile (TensorBoard, another run's pick) and the local end of every outgoing
connection, and a metrics port taken that way failed an actor at each restart. A port picked
outside it can still be taken by a process binding that very number; nothing here prevents that.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from contextlib import ExitStack
from pathlib import Path

__all__ = ["ephemeral_range", "free_port", "free_ports"]

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Where other kernels (and IANA) put ephemeral ports, when Linux's setting cannot be read.
_IANA_EPHEMERAL = (49152, 65535)
# Picked ports are at least this: below are the well-known and many fixed service ports.
_LOWEST = 10000
# Random tries outside the ephemeral range before falling back to the kernel's pick.
_MAX_TRIES = 500
# The ports this process picked lately, maybe not bound yet by whoever got them: not picked again.
_recent: deque[int] = deque(maxlen=1024)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, both ends included."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _IANA_EPHEMERAL
    return low, high


def _random_port_outside(low: int, high: int) -> int:
    """A random port from _LOWEST up, outside ``low..high`` (random: two launchers picking at
    once rarely try the same one); 0 (the kernel's pick) when the range leaves none."""
    below = max(0, low - _LOWEST)  # _LOWEST .. low - 1
    above = max(0, 65535 - max(high, _LOWEST - 1))  # high + 1 .. 65535
    if below + above == 0:
        return 0
    i = random.randrange(below + above)
    return _LOWEST + i if i < below else max(high, _LOWEST - 1) + 1 + i - below


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now, outside the ephemeral range
    and not picked lately by this process (from the kernel, inside the range, only if none is
    found in a few hundred tries).

    All sockets stay bound until every port is picked, so the ports are distinct.
    """
    low, high = ephemeral_range()
    with ExitStack() as stack:
        ports: list[int] = []
        tries = 0
        while len(ports) < count:
            tries += 1
            port = _random_port_outside(low, high) if tries <= _MAX_TRIES else 0
            if port in _recent:
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:  # in use (or picked already by this call)
                sock.close()
                continue
            stack.enter_context(sock)
            ports.append(sock.getsockname()[1])
        _recent.extend(ports)
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host``."""
    return free_ports(1, host)[0]
