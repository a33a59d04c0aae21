"""CPU-seconds of a benchmark's processes, to say where a path's cost goes (on a shared machine
wall time says how long; CPU time per unit of work says who spent it)."""

from __future__ import annotations

import psutil

__all__ = ["CpuClock"]


class CpuClock:
    """CPU-seconds (user + system) so far of each named process, with or without its children
    (a sampler's vLLM EngineCore is its child; a benchmark's own process is counted alone, its
    services being its children)."""

    def __init__(self, pids: dict[str, tuple[int, bool]]) -> None:
        self.procs = {name: (psutil.Process(pid), tree) for name, (pid, tree) in pids.items()}

    def read(self) -> dict[str, float]:
        out = {}
        for name, (proc, tree) in self.procs.items():
            total = 0.0
            for p in [proc, *(proc.children(recursive=True) if tree else [])]:
                try:
                    t = p.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                total += t.user + t.system
            out[name] = total
        return out

    def since(self, before: dict[str, float]) -> dict[str, float]:
        now = self.read()
        return {name: now[name] - before[name] for name in now}
