"""`rlfleet export` output is readable by whoever may read the folder: regular modes (0644 files,
0755 folders, less the umask), whatever mode the writers left (safetensors saves through a
temporary file of mode 0600, and the learner's final/ is copied with its modes)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from learner.export import export


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*")}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_have_regular_modes(tiny_model_dir: Path, tmp_path: Path, umask: int):
    final = tmp_path / "runs" / "lm" / "final"  # a language-model run's final/ folder
    shutil.copytree(tiny_model_dir, final)
    (final / "model.safetensors").chmod(0o600)  # as transformers' save_pretrained leaves it
    old = os.umask(umask)
    try:
        export(tmp_path / "runs" / "lm", tmp_path / "out", progress=False)
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "out")
    assert "model.safetensors" in modes and "rlfleet_export.json" in modes
    for name, mode in modes.items():
        is_dir = (tmp_path / "out" / name).is_dir()
        assert mode == (0o777 if is_dir else 0o666) & ~umask, (name, oct(mode))
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask
