"""The CPUs a service runs on: `rlfleet up` passes a service entry's `cpus` in `RLFLEET_CPUS`,
and the service pins itself once it has started up (`pin_to_assigned_cpus`), not at exec.

Pinning at exec confined every service's start-up (imports of torch and gRPC, building env pools,
the first weights) to its share of the cores while the other cores idled: the CartPole example
took 11.7-12.0 s from launch to its first env step pinned from the start, 8.3-8.7 s unpinned.
So a service pins itself at the point it is ready for its steady work: a gRPC service when it
reports SERVING (services.server.GrpcServer.set_serving), a game actor once it holds its first
weights, a `process` service before it starts its command (which inherits the CPUs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

__all__ = ["ENV_CPUS", "assigned_cpus", "format_cpus", "pin_to_assigned_cpus"]

log = logging.getLogger(__name__)

ENV_CPUS = "RLFLEET_CPUS"  # comma-separated CPU ids, e.g. "0,1"
_pinned = False


def format_cpus(cpus: list[int]) -> str:
    return ",".join(str(cpu) for cpu in cpus)


def assigned_cpus(environ: Mapping[str, str] = os.environ) -> list[int] | None:
    """The CPUs named in RLFLEET_CPUS, or None when unset, empty or not a list of CPU ids."""
    raw = environ.get(ENV_CPUS, "").strip()
    if not raw:
        return None
    try:
        cpus = [int(part) for part in raw.split(",")]
    except ValueError:
        log.warning("%s=%r is not a list of CPU ids: not pinned", ENV_CPUS, raw)
        return None
    return cpus if all(cpu >= 0 for cpu in cpus) else None


def pin_to_assigned_cpus() -> list[int] | None:
    """Pin every thread of this process to the assigned CPUs (once; later calls do nothing).

    Each existing thread is pinned by its id (affinity is per thread); threads started later
    inherit it from the thread that starts them. Returns the CPUs, or None when none are
    assigned, this is not Linux, or it was done already."""
    global _pinned
    cpus = assigned_cpus()
    if _pinned or cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    _pinned = True
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # no /proc: this thread only
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
        except OSError as exc:  # a CPU not available to this process after all
            log.warning("could not pin to CPUs %s: %s", cpus, exc)
            return None
    log.info("running on CPUs %s", format_cpus(cpus))
    return cpus
