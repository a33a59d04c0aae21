"""The studio's server side without a browser: the knob trees its form is built from, the run
state files it reads, the run book's checks and the HTTP app's errors and guards (Starlette's
test client over the real app; runs that really train are in tests/e2e/test_studio.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from launch.knobs import knob_fields, knob_rows
from launch.run_state import StateWriter, process_start, read_state
from launch.studio.app import TOKEN_COOKIE, create_studio_app
from launch.studio.book import RunBook
from services.config import RunSection
from services.registry import JOBS_GROUP, entry_point_registry, get_job

PPO = "run: {name: cart}\njob: {kind: ppo, env_id: CartPole-v1}\n"
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def book(tmp_path: Path) -> RunBook:
    return RunBook(tmp_path)


@pytest.fixture
def client(book: RunBook) -> TestClient:
    return TestClient(create_studio_app(book))


def a_run(book: RunBook, name: str, text: str = PPO) -> Path:
    """A run directory as `rlfleet up` leaves it (its run file), not started."""
    run_dir = book.root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(text.replace("cart", name))
    return run_dir


# --- knob trees -------------------------------------------------------------------------------


def test_every_job_kinds_knob_tree_is_json_and_matches_the_table() -> None:
    for kind in entry_point_registry(JOBS_GROUP):
        model = get_job(kind).settings
        tree = knob_fields(model)
        json.dumps(tree)  # what the page gets

        def names(fields: list[dict[str, Any]], indent: str = "") -> list[str]:
            out = []
            for f in fields:
                out.append(indent + f["name"])
                out += names(f.get("fields", []), indent + "  ")
            return out

        assert names(tree["fields"]) == [row["knob"] for row in knob_rows(model)], kind


def test_ppo_knobs_carry_inputs_bounds_defaults_and_other_tools_names() -> None:
    fields = {f["name"]: f for f in knob_fields(get_job("ppo").settings)["fields"]}
    lr = fields["learning_rate"]
    assert lr["input"] == "float" and lr["bounds"] == {">": 0} and "lr" in lr["aliases"]
    assert fields["env_id"]["required"] and fields["env_id"]["default"] is None
    assert fields["num_envs"]["input"] == "int" and fields["num_envs"]["bounds"][">="] == 1
    assert fields["anneal_lr"]["input"] == "bool"
    assert fields["device"]["input"] == "choice" and "cpu" in fields["device"]["choices"]
    assert fields["target_return"]["nullable"]
    run = {f["name"]: f for f in knob_fields(RunSection)["fields"]}
    assert run["name"]["required"] and run["name"]["description"]
    assert run["when_producers_gone"]["choices"] == ["stop", "wait"]


# --- run state --------------------------------------------------------------------------------


def test_state_file_follows_a_run_and_a_dead_launcher_reads_failed(tmp_path: Path) -> None:
    writer = StateWriter(tmp_path)
    writer.started()
    state = read_state(tmp_path)
    assert state is not None and state.state == "running" and state.pid == os.getpid()
    assert state.pid_start == process_start(os.getpid())
    figures = [{"source": "learner", "unit": "step", "done": 5.0, "total": 10.0}]
    writer.update(figures=figures, line="x  step 5/10  50%", services=[{"name": "a"}])
    state = read_state(tmp_path)
    assert state is not None and state.progress == figures and state.services == [{"name": "a"}]
    writer.ended(130, "stopped by SIGINT")
    state = read_state(tmp_path)
    assert state is not None and (state.state, state.exit) == ("stopped", 130)

    # A state that says running, written by a process that is gone (or a reused pid).
    raw = json.loads((tmp_path / "state.json").read_text())
    raw.update(state="running", pid_start=(raw["pid_start"] or 0) + 1)
    (tmp_path / "state.json").write_text(json.dumps(raw))
    state = read_state(tmp_path)
    assert state is not None and state.state == "failed" and "ended without saying" in state.message
    (tmp_path / "state.json").write_text("{not json")
    assert read_state(tmp_path) is None


# --- the run book -----------------------------------------------------------------------------


def test_listing_reads_states_and_never_fails_on_a_broken_run_file(book: RunBook) -> None:
    done = a_run(book, "done")
    writer = StateWriter(done)
    writer.started()
    writer.ended(0, "main service learner finished")
    a_run(book, "fresh")
    broken = book.root / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("a: [unclosed\n")
    (book.root / "not-a-run").mkdir()  # no run file: not listed
    entries = {e.id: e for e in book.entries()}
    assert set(entries) == {"done", "fresh", "broken"}
    assert (entries["done"].state, entries["done"].exit) == ("finished", 0)
    assert entries["done"].kind == "ppo" and entries["done"].watch == "episode"
    assert entries["fresh"].state == "new" and entries["broken"].kind == ""


def test_logs_are_tailed_by_name_only(book: RunBook) -> None:
    run_dir = a_run(book, "cart")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "learner.log").write_text("".join(f"line {i}\n" for i in range(500)))
    assert book.logs("cart") == ["learner.log"]
    assert book.log_tail("cart", "learner.log", 3) == ["line 497", "line 498", "line 499"]
    for name in ("../config.yaml", "config.yaml", "learner"):
        with pytest.raises(Exception, match="no log"):
            book.log_tail("cart", name)


def test_actions_are_refused_by_the_runs_state(book: RunBook) -> None:
    run_dir = a_run(book, "cart")
    StateWriter(run_dir).started()  # this test process plays a live launcher
    with pytest.raises(Exception, match="is running: stop it to delete it"):
        book.delete("cart")
    with pytest.raises(Exception, match="is running: stop it to resume it"):
        book.resume("cart")
    with pytest.raises(Exception, match="exists: resume it"):
        book.create(PPO)
    (run_dir / "state.json").unlink()
    with pytest.raises(Exception, match="is not running"):
        book.stop("cart")
    book.delete("cart")
    assert not run_dir.exists()


# --- the HTTP app -----------------------------------------------------------------------------


def test_validation_errors_name_each_field_with_its_line(client: TestClient) -> None:
    bad = "run: {name: x}\njob:\n  kind: ppo\n  env_id: CartPole-v1\n  lr: 3\n  num_envs: 0\n"
    reply = client.post("/api/studio/validate", json={"yaml": bad})
    assert reply.status_code == 422
    issues = {i["path"]: i for i in reply.json()["issues"]}
    assert (
        issues["job.lr"]["line"] == 5
        and "rlfleet calls it 'learning_rate'" in (issues["job.lr"]["message"])
    )
    assert issues["job.num_envs"]["line"] == 6
    assert "run file:5" in reply.json()["detail"]  # not the draft's temporary name
    reply = client.post("/api/studio/validate", json={"yaml": PPO})
    assert reply.json() == {"ok": True, "run": "cart", "services": ["env-0", "learner", "actor-0"]}
    elsewhere = PPO.replace("{name: cart}", "{name: cart, dir: /tmp/elsewhere}")
    reply = client.post("/api/studio/validate", json={"yaml": elsewhere})
    assert reply.status_code == 422 and reply.json()["issues"][0]["path"] == "run.dir"


def test_bad_requests_are_named(client: TestClient, book: RunBook) -> None:
    cases = [
        ("post", "/api/studio/validate", {"content": b"{not json", "headers": JSON}, 400, "JSON"),
        ("post", "/api/studio/validate", {"json": {"yaml": 3}}, 400, "'yaml' must be a string"),
        ("post", "/api/studio/runs", {"json": {"yaml": PPO, "start": "no"}}, 400, "'start'"),
        ("get", "/api/studio/runs/nope", {}, 404, "no run 'nope'"),
        ("get", "/api/studio/runs/..%2F..%2Fetc/config", {}, 404, ""),  # no route: plain 404
        ("get", "/api/studio/jobs/nope", {}, 404, "nope"),
        ("post", "/api/studio/runs/nope/stop", {"json": {}}, 404, "no run 'nope'"),
    ]
    for method, url, kwargs, status, detail in cases:
        reply = getattr(client, method)(url, **kwargs)
        assert reply.status_code == status, (url, reply.text)
        assert not detail or detail in reply.json()["detail"], (url, reply.text)
    a_run(book, "cart")
    reply = client.post("/api/studio/runs/cart/explode", json={})
    assert reply.status_code == 404 and "no action 'explode'" in reply.json()["detail"]
    reply = client.post("/api/studio/runs/cart/stop", json={})
    assert reply.status_code == 409 and "not running (new)" in reply.json()["detail"]
    reply = client.post("/api/studio/runs/cart/tasks", json={"kind": "ask", "prompt": ""})
    assert reply.status_code == 422 and "prompt" in reply.json()["detail"]
    reply = client.post("/api/studio/runs/cart/tasks", json={"kind": "dance"})
    assert reply.status_code == 404 and "no task kind 'dance'" in reply.json()["detail"]
    reply = client.get("/api/studio/runs/cart/files/%2E%2E/config.yaml")
    assert reply.status_code == 404


def test_a_new_run_is_written_listed_and_its_file_downloadable(
    client: TestClient, book: RunBook
) -> None:
    reply = client.post("/api/studio/runs", json={"yaml": PPO, "start": False})
    assert reply.status_code == 201 and reply.json()["state"] == "new"
    assert (book.root / "cart" / "config.yaml").read_text() == PPO
    assert [r["id"] for r in client.get("/api/studio/runs").json()["runs"]] == ["cart"]
    reply = client.get("/api/studio/runs/cart/config?download=1")
    assert reply.text == PPO and 'filename="cart.yaml"' in reply.headers["content-disposition"]
    reply = client.post("/api/studio/runs", json={"yaml": PPO, "start": False})
    assert reply.status_code == 409 and "exists" in reply.json()["detail"]
    assert client.delete("/api/studio/runs/cart").status_code == 204
    assert not (book.root / "cart").exists()


def test_catalogs_and_jobs_list_what_is_installed(client: TestClient) -> None:
    catalogs = client.get("/api/studio/catalogs").json()
    assert "CartPole-v1" in {e["env_id"] for e in catalogs["envs"]}
    assert "accuracy" in {r["name"] for r in catalogs["rewards"]}
    kinds = {j["kind"] for j in client.get("/api/studio/jobs").json()["jobs"]}
    assert {"ppo", "grpo", "dpo", "serve"} <= kinds
    tree = client.get("/api/studio/jobs/grpo").json()
    assert tree["kind"] == "grpo" and tree["run"]["fields"][0]["name"] == "name"
    assert 1024 <= client.get("/api/studio/free-port").json()["port"] <= 65535


def test_eval_samples_are_the_latest_evaluations(client: TestClient, book: RunBook) -> None:
    run_dir = a_run(book, "lm")
    (run_dir / "learner").mkdir()
    assert client.get("/api/studio/runs/lm/eval-samples").json() == {"eval": None}
    records = [
        {"version": v, "update": v, "samples": [{"prompt": "p", "score": v}]} for v in (0, 5)
    ]
    (run_dir / "learner" / "eval_samples.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    assert client.get("/api/studio/runs/lm/eval-samples").json() == {"eval": records[1]}


def test_a_token_guards_every_request_and_the_link_sets_a_cookie(book: RunBook) -> None:
    client = TestClient(create_studio_app(book, token="s3cret"))
    assert client.get("/api/studio").status_code == 403
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert client.get("/api/studio", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    reply = client.get("/?token=s3cret")
    assert reply.status_code == 200 and TOKEN_COOKIE in reply.headers["set-cookie"]
    assert client.get("/api/studio").status_code == 200  # the cookie from the link


def test_other_sites_pages_cannot_change_runs(client: TestClient, book: RunBook) -> None:
    a_run(book, "cart")
    reply = client.post(
        "/api/studio/runs", json={"yaml": PPO}, headers={"Origin": "http://evil.example"}
    )
    assert reply.status_code == 403 and "evil.example" in reply.json()["detail"]
    reply = client.post(
        "/api/studio/runs",
        content=b"yaml=x",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert reply.status_code == 403 and "application/json" in reply.json()["detail"]
    reply = client.delete("/api/studio/runs/cart", headers={"Origin": "http://evil.example"})
    assert reply.status_code == 403 and (book.root / "cart").exists()
    same = client.post(
        "/api/studio/validate", json={"yaml": PPO}, headers={"Origin": "http://testserver"}
    )
    assert same.status_code == 200


def test_the_page_loads_the_studio_script() -> None:
    from launch.dashboard.app import STATIC

    page = (STATIC / "index.html").read_text()
    assert '<script src="/static/studio.js"></script>' in page
    assert (STATIC / "studio.js").is_file()
