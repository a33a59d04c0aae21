"""`rlfleet jobs`: job kinds and their knobs, generated from the registered settings models."""

from __future__ import annotations

import pytest

from launch.cli import main
from services.registry import JOBS_GROUP, entry_point_registry, get_job


def test_jobs_lists_every_registered_kind_with_its_description(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["jobs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["kind", "description"]
    kinds = [line.split()[0] for line in out[1:]]
    assert kinds == list(entry_point_registry(JOBS_GROUP))
    assert any(line.startswith("ppo ") and "PPO/A2C over remote" in line for line in out)


@pytest.mark.parametrize("kind", list(entry_point_registry(JOBS_GROUP)))
def test_every_kind_prints_every_knob_with_a_description(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["jobs", kind]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{kind}: ")
    knobs = {line.split()[0] for line in out[2:] if not line.startswith(" ")}
    model = get_job(kind).settings
    assert knobs == set(model.model_fields)
    missing = [n for n, f in model.model_fields.items() if not f.description]
    assert not missing


def test_ppo_knob_rows_show_type_default_and_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "ppo"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["num_actors"].split()[:4] == ["num_actors", "int", "1", ">=1,"]
    assert "<=1024" in rows["num_actors"] and "actor processes" in rows["num_actors"]
    assert "(required)" in rows["env_id"] and "len>=1" in rows["env_id"]
    assert "cpu | cuda | auto" in rows["device"]


def test_nested_models_are_indented(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "serve"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("api_keys "))
    assert lines[at + 1].startswith("  key ") and "the key itself" in lines[at + 1]
    assert any(line.startswith("  max_body_bytes ") for line in lines)


def test_unknown_kind_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "ppx"]) == 2
    assert "unknown job kind 'ppx' (did you mean 'ppo'?" in capsys.readouterr().err
