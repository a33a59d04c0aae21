"""bench/results/ is committed: no result may record where one machine keeps its checkout."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench._shared import results
from bench._shared.results import RESULTS_DIR, ROOT, portable_paths, results_json

# An absolute path of a checkout, a home or a temp dir, anywhere in a string (commands too).
_ABSOLUTE = re.compile(r"(?<![\w.$~])/(root|home|work|tmp|Users)/")


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for key, item in node.items() for s in (*_strings(key), *_strings(item))]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return []


@pytest.mark.parametrize("path", sorted(RESULTS_DIR.glob("*.json")), ids=lambda p: p.name)
def test_result_files_hold_no_absolute_paths(path: Path) -> None:
    data = json.loads(path.read_text())
    found = [
        s for s in _strings(data) if _ABSOLUTE.search(s) or str(ROOT) in s or s.startswith("/")
    ]
    assert not found, f"{path.name}: absolute paths {found[:3]} (bench/_shared/results.py)"


def test_result_files_keep_the_machine_facts() -> None:
    # The rewrite of paths kept what a result is read with: where and under what load.
    for name in ("grpo_vs_trl.json", "sampler_throughput.json", "snake.json"):
        machine = json.loads((RESULTS_DIR / name).read_text())["machine"]
        assert machine["cpus"] and machine["versions"]["python"], name
        assert len(machine["loadavg_start"]) == len(machine["loadavg_end"]) == 3, name


def test_writer_makes_paths_relative_to_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = tempfile.gettempdir()
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: Path("/home/someone")))
    payload = {
        "config": str(ROOT / "examples" / "grpo_arith.yaml"),
        "run": ROOT / "runs" / "bench" / "export-run",
        "root": str(ROOT),
        "command": f"python {ROOT}/bench/lm/grpo_vs_trl.py --model {ROOT}/runs/models/tiny",
        "cache": [f"{tmp}/torchinductor_root", "/home/someone/.cache/rlfleet/wheelhouse"],
        "machine": {"cpus": 2, "loadavg_start": [1.5, 1.2, 1.0], "platform": "Linux-6.1"},
        "ratio": 0.5,
        "url": "http://127.0.0.1:8000/v1",
    }
    out = json.loads(results_json(payload))
    assert out["config"] == "examples/grpo_arith.yaml"
    assert out["run"] == "runs/bench/export-run"
    assert out["root"] == "."
    assert out["command"] == ("python bench/lm/grpo_vs_trl.py --model runs/models/tiny")
    assert out["cache"] == ["$TMPDIR/torchinductor_root", "~/.cache/rlfleet/wheelhouse"]
    assert out["machine"] == payload["machine"] and out["ratio"] == 0.5
    assert out["url"] == payload["url"]
    assert portable_paths(out) == out  # already portable: unchanged


def test_write_results_writes_portable_paths(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    results.write_results(target, {"config": str(ROOT / "examples" / "serve.yaml")})
    written = json.loads(target.read_text())
    assert written["config"] == "examples/serve.yaml"
    assert len(written["machine"]["loadavg_end"]) == 3
