"""Sampler replicas on CPUs of their own (services/placement.py replica_cpus): the rule `rlfleet
up` applies, the launcher's placement of the serve job's samplers, and the binding the vLLM
engine receives from it (sampler/lm/service.py configure_environment). No engine is started."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.placement import ENV_CPUS, ENV_OMP_BIND, replica_cpus


def _entries(*specs: tuple[str, list[int] | None]) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=name, cpus=cpus) for name, cpus in specs]


def test_replicas_get_disjoint_cpu_sets_from_the_cpus_nobody_else_holds() -> None:
    entries = _entries(("learner", [7]), ("sampler-0", None), ("sampler-1", None), ("gw", None))
    sets, warning = replica_cpus(entries, range(8), ["sampler-0", "sampler-1"])
    assert warning is None
    assert sets == {"sampler-0": [0, 1, 2, 3], "sampler-1": [4, 5, 6]}
    # Two replicas on two CPUs (examples/serve.yaml on the build machines): one CPU each.
    two = _entries(("sampler-0", None), ("sampler-1", None), ("gateway", None))
    assert replica_cpus(two, [0, 1], ["sampler-0", "sampler-1"]) == (
        {"sampler-0": [0], "sampler-1": [1]},
        None,
    )


def test_fewer_cpus_than_replicas_share_and_say_so() -> None:
    names = [f"sampler-{i}" for i in range(3)]
    sets, warning = replica_cpus(_entries(*((n, None) for n in names)), [0, 1], names)
    assert sets == {"sampler-0": [0], "sampler-1": [1], "sampler-2": [0]}
    assert warning is not None and "3 replicas on 2 CPU(s)" in warning


def test_one_replica_and_explicit_cpus_are_left_alone() -> None:
    assert replica_cpus(_entries(("sampler-0", None)), [0, 1], ["sampler-0"]) == ({}, None)
    entries = _entries(("sampler-0", [1]), ("sampler-1", None), ("sampler-2", None))
    sets, _ = replica_cpus(entries, [0, 1, 2, 3], ["sampler-0", "sampler-1", "sampler-2"])
    assert sets == {"sampler-1": [0, 2], "sampler-2": [3]}  # CPU 1 is sampler-0's
    # Every CPU named by others: the replicas divide all of them rather than get none.
    crowded = _entries(("learner", [0, 1]), ("sampler-0", None), ("sampler-1", None))
    assert replica_cpus(crowded, [0, 1], ["sampler-0", "sampler-1"])[0] == {
        "sampler-0": [0],
        "sampler-1": [1],
    }


def test_the_serve_jobs_vllm_samplers_are_placed_by_the_launcher(tmp_path: Path) -> None:
    from launch.launcher import Launcher
    from services.config import load_run_config

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    config = tmp_path / "serve.yaml"
    config.write_text(
        "run: {name: placement-test}\n"
        "services:\n"
        "  - {name: sampler-0, service: sampler, settings: {model_path: m}}\n"
        "  - {name: sampler-1, service: sampler, settings: {model_path: m}}\n"
        "  - {name: sampler-hf, service: sampler, settings: {model_path: m, engine: hf}}\n"
    )
    launcher = Launcher(load_run_config(config, {}), config, out=io.StringIO())
    placed = launcher._replica_cpus
    assert set(placed) == {"sampler-0", "sampler-1"}  # the hf engine binds nothing: not placed
    assert not set(placed["sampler-0"]) & set(placed["sampler-1"])
    assert set(placed["sampler-0"]) | set(placed["sampler-1"]) == os.sched_getaffinity(0)


def test_the_engine_binds_its_openmp_threads_to_the_assigned_cpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sampler.lm.service import configure_environment
    from sampler.lm.settings import SamplerSettings

    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR", "VLLM_RPC_BASE_PATH"):
        monkeypatch.setenv(name, str(tmp_path / name))  # none of its folders made elsewhere
    settings = SamplerSettings(model_path="m")
    monkeypatch.delenv(ENV_OMP_BIND, raising=False)
    monkeypatch.delenv(ENV_CPUS, raising=False)
    configure_environment(tmp_path, settings)
    assert ENV_OMP_BIND not in os.environ  # no CPUs assigned: vLLM's own "auto"
    monkeypatch.setenv(ENV_CPUS, "2,3")
    configure_environment(tmp_path, settings)
    # vLLM's CPU worker runs one OpenMP thread on each CPU of this list (OMP_NUM_THREADS=2).
    assert os.environ[ENV_OMP_BIND] == "2,3"
    monkeypatch.setenv(ENV_OMP_BIND, "nobind")  # one exported wins
    configure_environment(tmp_path, settings)
    assert os.environ[ENV_OMP_BIND] == "nobind"
