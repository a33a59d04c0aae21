"""The CPUs a service runs on: `rlfleet up` passes a service entry's `cpus` in `RLFLEET_CPUS`,
and the service pins itself once it has started up (`pin_to_assigned_cpus`), not at exec.

Pinning at exec confined every service's start-up (imports of torch and gRPC, building env pools,
the first weights) to its share of the cores while the other cores idled, which delayed the
run's first steps. So a service pins itself at the point it is ready for its steady work: a gRPC
service when it reports SERVING (services.server.GrpcServer.set_serving), a game actor once it
holds its first weights, a `process` service before it starts its command (which inherits the
CPUs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = [
    "ENV_CPUS",
    "ENV_OMP_BIND",
    "assigned_cpus",
    "format_cpus",
    "own_cpu_for",
    "pin_to_assigned_cpus",
    "replica_cpus",
]

log = logging.getLogger(__name__)

ENV_CPUS = "RLFLEET_CPUS"  # comma-separated CPU ids, e.g. "0,1"
# vLLM's CPU worker: the CPUs its OpenMP threads are bound to, one thread per CPU ("0,1";
# default "auto": vLLM's pick from the CPUs the engine process sees).
ENV_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
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


def own_cpu_for(
    entries: list[dict[str, Any]], name: str, environ: Mapping[str, str] = os.environ
) -> list[dict[str, Any]]:
    """Run-file service entries with `cpus` set: the entry called `name` on CPUs of its own,
    as many as the threads it computes with (its entry's `threads`, else OMP_NUM_THREADS,
    which `rlfleet up` sets to 1 unless given), the last ones this process may use; every
    other entry on the rest. Unchanged when that leaves the others no CPU, or off Linux. For a
    job whose one process is the critical path (a learner whose update the rest of the run
    waits for): the others time-sliced onto its cores slow every step of it."""
    if not hasattr(os, "sched_getaffinity"):
        return entries
    own = next((entry.get("threads") for entry in entries if entry["name"] == name), None)
    try:
        threads = own or max(int(environ.get("OMP_NUM_THREADS") or 1), 1)
    except ValueError:
        threads = 1
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= threads:
        return entries
    for entry in entries:
        entry["cpus"] = cpus[-threads:] if entry["name"] == name else cpus[:-threads]
    return entries


def replica_cpus(
    entries: Sequence[Any], usable: Sequence[int], replicas: Collection[str]
) -> tuple[dict[str, list[int]], str | None]:
    """CPU sets for the service entries named in ``replicas`` that have no ``cpus`` (entries
    with ``.name`` and ``.cpus``), when there are two or more: the ``usable`` CPUs no other
    entry names in its ``cpus``, divided into contiguous sets of near-equal size in entry
    order. Returns the name -> CPUs map, and a warning when there are fewer such CPUs than
    replicas (then each gets one CPU, shared round-robin).

    For engines that bind their compute threads to the CPUs they see (vLLM on CPU): each
    instance, left to itself, picks the same cores as the others, so they time-slice those
    while other cores idle. A single instance keeps the engine's own choice."""
    free = [e for e in entries if e.name in replicas and not e.cpus]
    if len(free) < 2:
        return {}, None
    taken = {cpu for e in entries if e.cpus for cpu in e.cpus}
    pool = [cpu for cpu in sorted(usable) if cpu not in taken] or sorted(usable)
    if len(pool) < len(free):
        warning = f"{len(free)} replicas on {len(pool)} CPU(s) {format_cpus(pool)}: they share"
        return {e.name: [pool[i % len(pool)]] for i, e in enumerate(free)}, warning
    size, extra = divmod(len(pool), len(free))
    sets: dict[str, list[int]] = {}
    start = 0
    for i, entry in enumerate(free):
        end = start + size + (1 if i < extra else 0)
        sets[entry.name] = pool[start:end]
        start = end
    return sets, None


def pin_to_assigned_cpus() -> list[int] | None:
    """Pin every thread of this process and of the processes it has started (a vLLM engine's
    core and workers) to the assigned CPUs, once; later calls do nothing.

    Affinity is per thread, so each existing one is pinned by its id; threads and processes
    started later inherit it from the thread that starts them. Returns the CPUs, or None when
    none are assigned, this is not Linux, or it was done already."""
    global _pinned
    cpus = assigned_cpus()
    if _pinned or cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    _pinned = True
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        for tid in _threads(pid):
            try:
                if os.sched_getaffinity(tid) <= set(cpus):
                    continue  # bound within them already (a vLLM worker's OpenMP threads)
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass  # the thread ended meanwhile
            except OSError as exc:  # a CPU not available to this process after all
                log.warning("could not pin to CPUs %s: %s", cpus, exc)
                return None
    log.info("running on CPUs %s", format_cpus(cpus))
    return cpus


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]  # gone, or no /proc: its main thread, if any


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux /proc/<pid>/task/<tid>/children), depth first."""
    found: list[int] = []
    for tid in _threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as children:
                kids = [int(child) for child in children.read().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *_descendants(kid)]
    return found
