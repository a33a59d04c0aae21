"""Where the sampler's compile caches go (SamplerSettings.compile_cache): which folders
configure_environment hands vLLM (VLLM_CACHE_ROOT) and torch inductor (TORCHINDUCTOR_CACHE_DIR),
and the lock a compiling engine start holds on the cache. No engine is started."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from sampler.lm.service import (
    compile_cache_lock,
    compile_cache_root,
    configure_environment,
    temp_dir,
)
from sampler.lm.settings import SamplerSettings

_SET = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR", "VLLM_RPC_BASE_PATH",
        "VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS", "HF_HUB_OFFLINE")  # fmt: skip
_LOCATION = ("RLFLEET_CACHE_DIR", "XDG_CACHE_HOME")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A clean slate: none of the variables configure_environment sets or reads, HOME in
    tmp_path (monkeypatch restores them all after the test)."""
    for name in _SET + _LOCATION:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    return home


def _configured(run_dir: Path, **settings: object) -> tuple[Path, Path]:
    configure_environment(run_dir, SamplerSettings(model_path="unused", **settings))  # type: ignore[arg-type]
    return Path(os.environ["VLLM_CACHE_ROOT"]), Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def test_shared_is_the_default_under_the_users_cache(env: Path, tmp_path: Path) -> None:
    assert SamplerSettings(model_path="unused").compile_cache == "shared"
    vllm, inductor = _configured(tmp_path / "run")
    versioned = vllm.parent
    assert versioned.parent == env.resolve() / ".cache" / "rlfleet" / "compile"
    assert versioned.name.startswith("vllm-") and "-torch-" in versioned.name
    assert "+" not in versioned.name  # 2.13.0+cpu -> 2.13.0_cpu
    assert (vllm.name, inductor) == ("vllm", versioned / "inductor")
    # The temp folder (inductor's precompiled header) is the user cache's, not the run's; not
    # set at all when that path is too long for a Unix socket.
    assert os.environ.get("TMPDIR") in (None, str(env.resolve() / ".cache" / "rlfleet" / "tmp"))


def test_shared_follows_xdg_cache_home_and_rlfleet_cache_dir(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    vllm, _ = _configured(tmp_path / "run")
    assert vllm.parent.parent == (tmp_path / "xdg").resolve() / "rlfleet" / "compile"

    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("RLFLEET_CACHE_DIR", str(tmp_path / "rlfleet-cache"))  # wins over XDG
    vllm, inductor = _configured(tmp_path / "run")
    assert vllm.parent.parent == (tmp_path / "rlfleet-cache").resolve() / "compile"
    assert inductor.parent == vllm.parent


def test_two_runs_share_one_cache(env: Path, tmp_path: Path) -> None:
    settings = SamplerSettings(model_path="unused")
    assert compile_cache_root(tmp_path / "a", settings) == compile_cache_root(
        tmp_path / "b", settings
    )
    run = SamplerSettings(model_path="unused", compile_cache="run")
    assert compile_cache_root(tmp_path / "a", run) != compile_cache_root(tmp_path / "b", run)


def test_run_keeps_the_caches_in_the_run_directory(env: Path, tmp_path: Path) -> None:
    vllm, inductor = _configured(tmp_path / "run", compile_cache="run")
    cache = (tmp_path / "run").resolve() / "cache"
    assert (vllm, inductor) == (cache / "vllm", cache / "inductor")
    assert os.environ.get("TMPDIR") in (None, str(cache / "tmp"))
    assert not (env / ".cache").exists()  # nothing under the user's cache


def test_every_run_gets_the_same_short_temp_folder(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # inductor's precompiled header lives in the temp folder: one folder for all runs means
    # one header. A short cache folder (socket paths), as pytest's tmp_path is not.
    short = Path(tempfile.mkdtemp(prefix="rlf-", dir="/tmp"))
    try:
        monkeypatch.setenv("RLFLEET_CACHE_DIR", str(short))
        for run in ("a", "b"):
            monkeypatch.delenv("TMPDIR", raising=False)
            monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
            _configured(short / run)
            assert os.environ["TMPDIR"] == str(short.resolve() / "tmp")
            # vLLM's sockets stay with the run (they outlive a killed engine)
            ipc = short.resolve() / run / "cache" / "ipc"
            assert os.environ["VLLM_RPC_BASE_PATH"] == str(ipc) and ipc.is_dir()
        assert (short / "tmp").is_dir()
        run = SamplerSettings(model_path="unused", compile_cache="run")
        assert temp_dir(short / "a", run) == short.resolve() / "a" / "cache" / "tmp"
        monkeypatch.delenv("TMPDIR")
        monkeypatch.setenv("RLFLEET_CACHE_DIR", str(short / ("x" * 60)))  # too long for a socket
        _configured(short / "a")
        assert "TMPDIR" not in os.environ  # the system's
    finally:
        shutil.rmtree(short)


def test_a_path_is_used_as_the_cache_root(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm, inductor = _configured(tmp_path / "run", compile_cache=str(tmp_path / "mine"))
    assert (vllm, inductor) == (tmp_path / "mine" / "vllm", tmp_path / "mine" / "inductor")

    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    vllm, _ = _configured(tmp_path / "run", compile_cache="~/compiled")  # ~ expanded
    assert vllm == env.resolve() / "compiled" / "vllm"
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name)
    vllm, _ = _configured(tmp_path / "run", compile_cache="rel")  # relative: to the cwd
    assert vllm == tmp_path.resolve() / "rel" / "vllm"


def test_variables_set_already_win(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "v"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "i"))
    assert _configured(tmp_path / "run") == (tmp_path / "v", tmp_path / "i")


def test_an_empty_path_is_refused() -> None:
    with pytest.raises(ValidationError):
        SamplerSettings(model_path="unused", compile_cache="")


def test_a_compiling_engine_start_holds_the_cache_lock(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "v"))
    compiling = SamplerSettings(model_path="unused", enforce_eager=False)
    lock_path = tmp_path / "v" / "rlfleet-compile.lock"
    waited: list[bool] = []

    async def waiting() -> None:
        waited.append(True)

    async def main() -> None:
        stop = asyncio.Event()
        async with compile_cache_lock(compiling, stop, waiting):
            # another sampler's attempt
            with open(lock_path, "a+b") as other, pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(lock_path, "a+b") as other:  # released
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Held elsewhere: this one waits (told once), then gives up when stopped.
            stop_soon = asyncio.get_running_loop().call_later(0.8, stop.set)
            with pytest.raises(asyncio.CancelledError):
                async with compile_cache_lock(compiling, stop, waiting):
                    pass
            stop_soon.cancel()
        # Eager engines (the default) compile no model graph: nothing is locked.
        eager = SamplerSettings(model_path="unused")
        with open(lock_path, "a+b") as other:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            async with compile_cache_lock(eager, stop, waiting):
                pass

    asyncio.run(main())
    assert waited == [True]
