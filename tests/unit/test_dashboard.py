"""The dashboard's JSON endpoints over real metrics.jsonl files (launch.dashboard), its server
on a real socket, and the settings that turn it on and off. The page in a browser, on a real
run, is tests/e2e/test_dashboard.py."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from launch.dashboard.app import create_app
from launch.dashboard.live import LiveView, dashboard_port_from_env, tensorboard_from_env
from launch.dashboard.metrics import Runs
from launch.dashboard.server import DashboardServer
from services.errors import ConfigError


def record(t: float, service: str = "learner", **values: Any) -> str:
    return json.dumps({
        "time": t, "kind": "metrics", "type": "rlfleet.bus.v1.Metrics", "service": service,
        "step": int(t), "version": 1, "values": values,
    })  # fmt: skip


def write(path: Path, *lines: str, end: str = "\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + end)


def points(reply: dict[str, Any]) -> dict[tuple[str, str], list[list[float]]]:
    return {(s["key"], s["service"]): s["points"] for s in reply["series"]}


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    return tmp_path / "runs"


def client(root: Path, current: str = "now", status: Any = None) -> TestClient:
    return TestClient(create_app(Runs(root, current=root / current), status))


def test_metrics_are_read_incrementally(runs_root: Path) -> None:
    path = runs_root / "now" / "metrics.jsonl"
    write(
        path,
        record(1, **{"charts/episodic_return": 10.0}),
        record(2, "actor-0", **{"charts/SPS": 5}),
    )
    api = client(runs_root)

    first = api.get("/api/runs/now/metrics").json()
    assert (first["cursor"], first["reset"], first["skipped"]) == (2, True, 0)
    assert points(first) == {
        ("charts/SPS", "actor-0"): [[2.0, 5.0]],
        ("charts/episodic_return", "learner"): [[1.0, 10.0]],
    }
    query = {"since": first["cursor"], "generation": first["generation"]}

    # A new record and half of the next one: only the complete one comes, once.
    whole, half = record(3, **{"charts/episodic_return": 30.0}), record(4, **{"losses/kl": 0.5})
    write(path, whole, half[:20], end="")
    second = api.get("/api/runs/now/metrics", params=query).json()
    assert (second["cursor"], second["reset"]) == (3, False)
    assert points(second) == {("charts/episodic_return", "learner"): [[3.0, 30.0]]}

    write(path, half[20:])
    third = api.get("/api/runs/now/metrics", params={**query, "since": 3}).json()
    assert points(third) == {("losses/kl", "learner"): [[4.0, 0.5]]}
    assert third["cursor"] == 4 and third["skipped"] == 0
    nothing = api.get("/api/runs/now/metrics", params={**query, "since": 4}).json()
    assert nothing["series"] == [] and nothing["cursor"] == 4


def test_runs_are_listed_current_first_then_newest(runs_root: Path) -> None:
    for name, mtime in (("old", 1_000), ("newer", 2_000)):
        write(runs_root / name / "metrics.jsonl", record(1, x=1.0))
        os.utime(runs_root / name / "metrics.jsonl", (mtime, mtime))
    (runs_root / "no-metrics").mkdir()  # a directory without metrics.jsonl is no run
    (runs_root / "stray.txt").write_text("not a run")
    runs = client(runs_root, current="now").get("/api/runs").json()["runs"]
    assert [(r["id"], r["current"]) for r in runs] == [
        ("now", True),  # the current run, listed before its first metrics line
        ("newer", False),
        ("old", False),
    ]
    assert runs[0]["modified"] is None and runs[1]["modified"] == 2_000


def test_an_earlier_run_has_its_own_series(runs_root: Path) -> None:
    write(runs_root / "old" / "metrics.jsonl", record(1, **{"charts/episodic_return": 9.0}))
    write(runs_root / "now" / "metrics.jsonl", record(5, **{"charts/episodic_return": 50.0}))
    api = client(runs_root)
    assert points(api.get("/api/runs/old/metrics").json()) == {
        ("charts/episodic_return", "learner"): [[1.0, 9.0]]
    }
    assert points(api.get("/api/runs/now/metrics").json()) == {
        ("charts/episodic_return", "learner"): [[5.0, 50.0]]
    }


def test_bad_lines_are_skipped_counted_and_named(runs_root: Path) -> None:
    write(
        runs_root / "now" / "metrics.jsonl",
        "{not json",
        "[1, 2]",
        json.dumps({"values": {"a": 1}}),
        json.dumps({"time": 1, "values": "high"}),
        "",  # blank lines are nothing, not errors
        json.dumps({"time": 2, "service": "s", "values": {"a": 1, "b": "x", "c": True, "d": None}}),
        json.dumps({"time": 3, "service": "s", "values": {"a": float("nan")}}),
    )
    reply = client(runs_root).get("/api/runs/now/metrics").json()
    assert reply["skipped"] == 4 and reply["cursor"] == 2
    assert reply["problems"] == [
        "metrics.jsonl line 1: not JSON",
        "metrics.jsonl line 2: a JSON list, not an object",
        "metrics.jsonl line 3: no numeric 'time'",
        "metrics.jsonl line 4: no 'values' object",
    ]
    assert points(reply) == {("a", "s"): [[2.0, 1.0]]}  # strings, bools, nulls, NaN: no points


def test_a_missing_metrics_file_is_an_empty_run(runs_root: Path) -> None:
    reply = client(runs_root).get("/api/runs/now/metrics").json()
    assert (reply["series"], reply["cursor"], reply["skipped"]) == ([], 0, 0)


def test_a_shrunk_file_is_read_again_under_a_new_generation(runs_root: Path) -> None:
    path = runs_root / "now" / "metrics.jsonl"
    write(path, record(1, a=1.0), record(2, a=2.0))
    api = client(runs_root)
    first = api.get("/api/runs/now/metrics").json()
    path.write_text(record(7, a=7.0) + "\n")  # replaced by a shorter file
    query = {"since": first["cursor"], "generation": first["generation"]}
    again = api.get("/api/runs/now/metrics", params=query).json()
    assert again["reset"] is True and again["generation"] != first["generation"]
    assert points(again) == {("a", "learner"): [[7.0, 7.0]]} and again["cursor"] == 1


def test_unknown_runs_and_bad_cursors_are_refused(runs_root: Path) -> None:
    write(runs_root / "now" / "metrics.jsonl", record(1, a=1.0))
    write(runs_root.parent / "outside" / "metrics.jsonl", record(1, a=1.0))
    api = client(runs_root)
    missing = api.get("/api/runs/nope/metrics")
    assert missing.status_code == 404 and "no run 'nope'" in missing.json()["detail"]
    assert api.get("/api/runs/..%2Foutside/metrics").status_code == 404
    assert api.get("/api/runs/now/metrics", params={"since": -1}).status_code == 422
    assert api.get("/api/runs/now/metrics", params={"since": "x"}).status_code == 422


def test_services_come_from_the_status_source(runs_root: Path) -> None:
    states = [{"name": "learner", "kind": "learner", "state": "healthy", "restarts": 0}]
    reply = client(runs_root, status=lambda: states).get("/api/services").json()
    assert reply == {"run": "now", "services": states}
    assert client(runs_root).get("/api/services").json()["services"] == []


def test_the_page_and_its_chart_library_are_served(runs_root: Path) -> None:
    api = client(runs_root)
    page = api.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '<script src="/static/vendor/uPlot.iife.min.js">' in page.text
    for asset in ("vendor/uPlot.iife.min.js", "vendor/uPlot.min.css", "app.js", "style.css"):
        response = api.get(f"/static/{asset}")
        assert response.status_code == 200 and len(response.content) > 100, asset
    assert "javascript" in api.get("/static/app.js").headers["content-type"]


def test_the_server_listens_on_a_free_port_until_stopped(runs_root: Path) -> None:
    write(runs_root / "now" / "metrics.jsonl", record(1, a=1.0))
    server = DashboardServer(create_app(Runs(runs_root, current=runs_root / "now")))
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:") and server.port > 0
        assert httpx.get(url + "api/runs", timeout=5).json()["runs"][0]["id"] == "now"
        # The same port again is busy: an OSError at start, nothing left running.
        with pytest.raises(OSError):
            DashboardServer(create_app(Runs(runs_root)), port=server.port).start()
    finally:
        server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "api/runs", timeout=2)


async def test_a_busy_port_turns_the_dashboard_off_with_one_line(tmp_path: Path) -> None:
    said: list[str] = []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        live = LiveView(
            tmp_path / "run", dashboard_port=port, tensorboard=False, status=list,
            say=said.append, environ={},
        )  # fmt: skip
        await live.start()
        await live.stop()
    assert said == [f"dashboard off: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_settings_from_the_environment() -> None:
    assert dashboard_port_from_env({}) == 0
    assert dashboard_port_from_env({"RLFLEET_DASHBOARD_PORT": "8050"}) == 8050
    for bad in ("http", "-1", "70000"):
        with pytest.raises(ConfigError, match="RLFLEET_DASHBOARD_PORT"):
            dashboard_port_from_env({"RLFLEET_DASHBOARD_PORT": bad})
    assert tensorboard_from_env({"RLFLEET_TENSORBOARD": "1"})
    assert not tensorboard_from_env({"RLFLEET_TENSORBOARD": "0"}) and not tensorboard_from_env({})


def test_non_finite_values_flagged_in_the_file_are_marked_on_their_series(
    runs_root: Path,
) -> None:
    nan_loss = json.loads(record(2, **{"losses/pg_loss": None, "charts/SPS": 5.0}))
    write(
        runs_root / "now" / "metrics.jsonl",
        record(1, **{"charts/SPS": 4.0}),
        json.dumps({**nan_loss, "nonfinite": ["losses/pg_loss"]}),
    )
    reply = client(runs_root).get("/api/runs/now/metrics").json()
    marks = {(s["key"], s["service"]): s["nonfinite"] for s in reply["series"]}
    # The loss has no point, yet its series is there, saying when it was NaN/inf.
    assert marks == {("charts/SPS", "learner"): [], ("losses/pg_loss", "learner"): [2.0]}
    assert points(reply)[("losses/pg_loss", "learner")] == []


def test_points_carry_the_run_env_steps_and_series_their_role(runs_root: Path) -> None:
    path = runs_root / "now" / "metrics.jsonl"
    write(
        path,
        # An actor reports before the learner's first update: no env steps known yet.
        record(1, "actor-0", **{"charts/episodic_return": 9.0, "charts/episodes": 1.0}),
        record(2, **{"charts/global_step": 256.0, "charts/episodic_return": 10.0}),
        record(3, "actor-1", **{"charts/episodic_return": 12.0, "charts/episodes": 2.0}),
        record(4, "env-0", **{"env/steps_per_s": 5.0}),
    )
    api = client(runs_root)
    first = api.get("/api/runs/now/metrics").json()
    got = {(s["key"], s["service"]): (s["role"], s["steps"]) for s in first["series"]}
    assert got[("charts/episodic_return", "actor-0")] == ("actor", [None])
    assert got[("charts/episodic_return", "learner")] == ("learner", [256.0])
    assert got[("charts/episodic_return", "actor-1")] == ("actor", [256.0])
    assert got[("env/steps_per_s", "env-0")] == ("", [256.0])

    # A later poll: the steps go on from the last global_step read, roles are remembered.
    write(
        path,
        record(5, "actor-0", **{"charts/episodic_return": 20.0, "charts/episodes": 3.0}),
        record(6, **{"charts/global_step": 512.0, "losses/entropy": 0.6}),
    )
    query = {"since": first["cursor"], "generation": first["generation"]}
    second = api.get("/api/runs/now/metrics", params=query).json()
    got = {(s["key"], s["service"]): (s["role"], s["steps"]) for s in second["series"]}
    assert got == {
        ("charts/episodic_return", "actor-0"): ("actor", [256.0]),
        ("charts/episodes", "actor-0"): ("actor", [256.0]),
        ("charts/global_step", "learner"): ("learner", [512.0]),
        ("losses/entropy", "learner"): ("learner", [512.0]),
    }

    # A replaced file starts over: no env steps and no roles carried from the old one.
    path.write_text(record(7, "actor-0", **{"charts/SPS": 3.0}) + "\n")
    third = api.get("/api/runs/now/metrics", params={"since": 6, "generation": 0}).json()
    assert [(s["role"], s["steps"]) for s in third["series"]] == [("", [None])]
