"""The benchmarks' own environments for third-party reference trainers (CleanRL and EnvPool in
``bench/.venv-compare``, TRL in ``bench/.venv-trl``): made on first use from a pinned
requirements file, remade when that file changes, never part of the project's install.

A venv ``layered_over`` the project's puts the project venv's site-packages on its path after
its own (one ``.pth`` line), so the reference runs the project's very torch and transformers and
pip installs only what the reference adds.

Not a benchmark itself.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ensure_venv"]


def ensure_venv(
    venv: Path,
    requirements: Path,
    *,
    layered_over: Path | None = None,
    pip_flags: Sequence[str] = (),
) -> Path:
    """The venv's python, created from ``requirements`` on first use (or when that file, or
    the venv it is layered over, changed). Raises RuntimeError with pip's last lines when it
    cannot be made."""
    python = venv / "bin" / "python"
    key = requirements.read_bytes()
    if layered_over is not None:
        key += str(layered_over.resolve()).encode()
    digest = hashlib.sha256(key).hexdigest()
    marker = venv / ".requirements.sha256"
    if python.exists() and marker.exists() and marker.read_text().strip() == digest:
        return python
    print(f"creating {venv} from {requirements.name} (a few minutes)", flush=True)
    _run([sys.executable, "-m", "venv", "--clear", str(venv)])
    if layered_over is not None:
        purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
        lower = sysconfig.get_path("purelib", vars={"base": str(layered_over)})
        (purelib / "layered-over.pth").write_text(lower + "\n")
    _run([str(python), "-m", "pip", "install", "-q", *pip_flags, "-r", str(requirements)])
    marker.write_text(digest + "\n")
    return python


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {(proc.stdout + proc.stderr)[-1500:]}")
