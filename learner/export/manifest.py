"""``rlfleet_export.json``: what an export folder holds and where it came from.

Written last (its presence means the folder is complete): the format, the run, the weight
version, the source (final/ folder or DeepSpeed checkpoint), the quantization scheme with the
quantizer's library versions, the exporting libraries' versions, and the sha256 and size of every
other file in the folder. `verify` recomputes the digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "MANIFEST_FILE",
    "file_digests",
    "library_versions",
    "sha256",
    "verify",
    "write",
]

MANIFEST_FILE = "rlfleet_export.json"
FORMAT = "rlfleet-export/1"
_CHUNK = 1 << 20


def sha256(path: Path, advance: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if advance is not None:
                advance(len(chunk))
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_FILE
    )


def file_digests(folder: Path, *, progress: bool = True) -> dict[str, dict[str, Any]]:
    """{relative path: {"sha256", "bytes"}} of every file but the manifest (a rich progress bar
    over the bytes when ``progress``)."""
    files = _files(folder)
    total = sum(p.stat().st_size for p in files)
    out: dict[str, dict[str, Any]] = {}
    if not progress:
        for p in files:
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256(p), "bytes": p.stat().st_size}
        return out
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("sha256", total=total)
        for p in files:
            out[p.relative_to(folder).as_posix()] = {
                "sha256": sha256(p, lambda n: bar.advance(task, n)),
                "bytes": p.stat().st_size,
            }
    return out


def library_versions(*names: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def write(folder: Path, fields: dict[str, Any], *, progress: bool = True) -> dict[str, Any]:
    """Hash the folder's files and write the manifest (to a temporary name, then renamed)."""
    manifest = {
        "format": FORMAT,
        **fields,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": file_digests(folder, progress=progress),
    }
    tmp = folder / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST_FILE)
    return manifest


def verify(folder: str | os.PathLike[str]) -> list[str]:
    """Problems with an export folder against its manifest (empty: every file is as recorded
    and nothing was added)."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return [f"{path}: missing"]
    manifest = json.loads(path.read_text())
    problems = []
    recorded = manifest.get("files", {})
    present = {p.relative_to(folder).as_posix() for p in _files(folder)}
    for name, entry in sorted(recorded.items()):
        if name not in present:
            problems.append(f"{name}: missing")
        elif sha256(folder / name) != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
    problems += [f"{name}: not in the manifest" for name in sorted(present - set(recorded))]
    return problems
