"""Code named from a run file: ``module:attr`` (an importable module) or ``path/file.py:attr``.

Plugin registries (rewards, envs) accept such references beside their entry points, so a user can
point a run at a function or class without packaging it. This module only finds and imports the
module; what the attribute must be is the registry's business. Relative file paths are from the
current directory (where ``rlfleet up`` runs, as for ``model_path`` and ``run.dir``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["import_reference_module", "is_reference", "split_reference"]

_FILE_MODULES: dict[Path, ModuleType] = {}  # one import per file and process


def is_reference(name: str) -> bool:
    """Whether a plugin name is a reference rather than a registered name (which has no colon)."""
    return ":" in name


def split_reference(ref: str, forms: str) -> tuple[str, str]:
    """``(where, attr)`` of ``where:attr``; ValueError naming the accepted ``forms``."""
    where, _, attr = ref.rpartition(":")
    if not where or not attr:
        raise ValueError(f"expected {forms}")
    return where, attr


def _file_module(path: Path) -> ModuleType:
    """The module of a ``.py`` file, imported once per process under a name unique to its
    absolute path (two ``rewards.py`` in different folders do not collide)."""
    path = path.resolve()
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    if not path.is_file():
        raise ValueError(f"file {path} not found (relative paths are from the current directory)")
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"rlfleet_file_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        raise ValueError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    _FILE_MODULES[path] = module
    return module


def import_reference_module(where: str) -> tuple[ModuleType, str, str]:
    """The module a reference's ``where`` part names, with a short label for messages and its
    origin ("file /abs/x.py" or "module pkg.x"); ValueError saying what went wrong."""
    if where.endswith(".py"):
        return _file_module(Path(where)), Path(where).stem, f"file {Path(where).resolve()}"
    try:
        module = importlib.import_module(where)
    except Exception as exc:
        raise ValueError(f"cannot import module {where}: {type(exc).__name__}: {exc}") from exc
    return module, where, f"module {where}"
