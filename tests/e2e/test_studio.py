"""End to end: ``rlfleet studio`` in headless Chromium, on real runs.

A CartPole PPO run is made from the new-run form (a bad learning rate first: the validator's
message shows beside that field; the run file downloads as written), started, watched (its return
curve gains points), stopped and resumed; the studio itself is restarted while the run trains and
the run goes on; once it finished it plays an episode as a video in the page and exports to
ONNX with a progress bar. A second, shorter run is overlaid on the first, smoothed, then deleted.
A screenshot of each view is kept in the test's tmp dir (paths printed).

The language-model part puts the tiny model (``rlfleet init-model``'s code) as a GRPO run's
final model, asks it a prompt from the page's prompt box (greedy and sampled answers, through
``rlfleet ask``), exports it and serves the export from the page (the transformers engine), and
the official ``openai`` client gets an answer at the base URL the page shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launch.run_state import read_state
from services.bus.nats_server import parent_death_signal
from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS, playwright_or_skip
from tests.fixtures.launch import assert_nothing_left

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
    # Every step waits on a run or a command the studio starts, which a loaded machine slows
    # several-fold.
    pytest.mark.timeout(1800),
]

# Waits in the page: each is paced by a run (its start-up, its first points, its end) or by a
# command the studio runs (play, export, ask, a serve job's start-up), minutes on a loaded
# machine; a step that never comes still fails, named by the wait.
WAIT_TIMEOUT_MS = 600_000
RETURN_CHART = '.chart[data-key="charts/episodic_return"]'
# A GRPO run of two small updates on the transformers engine (no vLLM start-up), evaluated once.
LM_KNOBS = {
    "job.engine": "hf",
    "job.device": "cpu",
    "job.total_updates": "2",
    "job.groups_per_update": "2",
    "job.group_size": "4",
    "job.prompts_per_call": "4",
    "job.minibatch_size": "8",
    "job.max_tokens": "8",
    "job.sft_steps": "20",
    "job.eval_count": "8",
    "job.eval_every": "2",
}
# The example's hyperparameters (examples/cartpole_ppo.yaml), a short budget.
PPO_KNOBS = {
    "job.env_id": "CartPole-v1",
    "job.num_envs": "8",
    "job.rollout_length": "32",
    "job.update_epochs": "20",
    "job.minibatch_size": "256",
    "job.learning_rate": "0.002",
    "job.gamma": "0.98",
    "job.gae_lambda": "0.8",
    "job.ent_coef": "0",
}


class Studio:
    """``rlfleet studio --workdir DIR --port 0`` in the background; ``url`` once it listens."""

    def __init__(self, workdir: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "studio", "--workdir", str(workdir), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=parent_death_signal(signal.SIGTERM),  # never outlives the test
        )
        self.lines: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                match = re.search(r"rlfleet studio at (http://\S+)", line)
                if match:
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(180):  # a loaded machine slows its imports several-fold
            self.stop()
            raise AssertionError("the studio did not start:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def runs_stopped(workdir: Path) -> Iterator[None]:
    """At the end, stop any run still running (SIGINT to its launcher) and check that nothing
    of any run is left."""
    try:
        yield
    except BaseException:
        print(diagnostics(workdir))
        raise
    finally:
        runs = [p for p in (workdir / "runs").glob("*") if p.is_dir()]
        for run_dir in runs:
            state = read_state(run_dir)
            if state is not None and state.state == "running":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(state.pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        for run_dir in runs:
            while time.monotonic() < deadline:
                state = read_state(run_dir)
                if state is None or state.state != "running":
                    break
                time.sleep(0.5)
            assert_nothing_left(run_dir)


def diagnostics(workdir: Path) -> str:
    """Each run's state and the end of its launcher's log (what a failure needs to be read)."""
    out = []
    for run_dir in sorted((workdir / "runs").glob("*")):
        state = read_state(run_dir)
        out.append(f"--- {run_dir.name}: {state}")
        log = run_dir / "logs" / "launcher.log"
        if log.exists():
            out += log.read_text(errors="replace").splitlines()[-25:]
    return "\n".join(out)


@contextlib.contextmanager
def browser_page(sync_playwright: Any) -> Iterator[Any]:
    """A page in headless Chromium that accepts the studio's confirmations (delete, afresh)."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(WAIT_TIMEOUT_MS)
        page.on("dialog", lambda dialog: dialog.accept())
        yield page
        browser.close()


def fill_form(page: Any, kind: str, knobs: dict[str, str]) -> None:
    page.click("#studio-nav button[data-view=new]")
    page.select_option("#job-kind", kind)
    page.wait_for_selector(f'[data-path="job.kind"], #job-description:has-text("{kind[:3]}")')
    for path, value in knobs.items():
        selector = f'[data-path="{path}"]'
        if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
            page.select_option(selector, value)
        else:
            page.fill(selector, value)


def shoot(page: Any, folder: Path, name: str) -> Path:
    path = folder / f"studio-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def run_state(page: Any) -> str:
    return str(page.inner_text("#run-state"))


def wait_state(page: Any, *states: str) -> None:
    wanted = "[" + ",".join(f'"{s}"' for s in states) + "]"
    page.wait_for_function(
        f"() => {wanted}.includes(document.getElementById('run-state').textContent)"
    )


def points(page: Any) -> int:
    return int(page.get_attribute(RETURN_CHART, "data-points") or 0)


@pytest.fixture
def studios() -> Iterator[list[Studio]]:
    """The studios a test starts, stopped at its end whatever happened."""
    started: list[Studio] = []
    yield started
    for studio in started:
        studio.stop()


def test_a_game_run_from_the_form_to_an_exported_policy(
    tmp_path: Path, studios: list[Studio]
) -> None:
    sync_playwright = playwright_or_skip()
    workdir = tmp_path / "work"
    workdir.mkdir()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    studio = Studio(workdir)
    studios.append(studio)
    with runs_stopped(workdir), browser_page(sync_playwright) as page:
        page.goto(studio.url)
        page.wait_for_selector("#view-runs:not([hidden])")
        assert page.is_visible("#studio-nav")
        shoot(page, shots, "runs-empty")

        # The form: a bad value is named beside its field; the run file is what the form says.
        fill_form(page, "ppo", {"run.name": "cartpole-a", **PPO_KNOBS, "job.learning_rate": "-1"})
        page.fill('[data-path="job.total_timesteps"]', "32768")
        page.click("#validate-run")
        issue = page.wait_for_selector('[data-field="job.learning_rate"].invalid .issue')
        assert "greater than 0" in issue.inner_text()
        assert "line" in page.inner_text("#run-issues")
        shoot(page, shots, "new-run-invalid")
        page.fill('[data-path="job.learning_rate"]', "0.002")
        page.click("#validate-run")
        page.wait_for_selector("#run-issues li.ok")
        text = page.input_value("#run-yaml")
        assert "  env_id: CartPole-v1\n" in text and "  total_timesteps: 32768\n" in text
        with page.expect_download() as download:
            page.click("#download-run")
        assert Path(download.value.path()).read_text() == text
        assert download.value.suggested_filename == "cartpole-a.yaml"

        # Start, watch the curve grow, stop, resume.
        page.click("#start-run")
        page.wait_for_selector("#run-panel:not([hidden])")
        wait_state(page, "running")
        page.wait_for_function(
            f"() => Number(document.querySelector('{RETURN_CHART}')?.dataset.points) > 0"
        )
        first = points(page)
        page.wait_for_function(
            f"() => Number(document.querySelector('{RETURN_CHART}').dataset.points) > {first}"
        )
        run_dir = workdir / "runs" / "cartpole-a"
        assert (run_dir / "config.yaml").read_text() == text
        shoot(page, shots, "curves-live")
        page.click("#run-actions button[data-action=stop]")
        wait_state(page, "stopped")
        state = read_state(run_dir)
        assert state is not None and state.exit == 130 and state.message == "stopped by SIGINT"
        page.click("#run-actions button[data-action=resume]")
        wait_state(page, "running")

        # The studio restarts while the run trains; the run goes on and the new studio shows it.
        studio.stop()
        state = read_state(run_dir)
        assert state is not None and state.state == "running", state
        studio = Studio(workdir)
        studios.append(studio)
        page.goto(studio.url + "#run/cartpole-a")
        wait_state(page, "running", "finished")
        wait_state(page, "finished")
        assert "(restored)" in (run_dir / "logs" / "learner.log").read_text()

        # Watch: an episode as a video in the page.
        page.click("#play-episode")
        page.wait_for_selector("#episode-video:not([hidden])")
        assert "episode return" in page.inner_text("#play-status")
        video = run_dir / "studio" / "episode-1.webm"
        assert video.stat().st_size > 1000
        source = page.get_attribute("#episode-video", "src")
        assert source is not None and source.endswith("/files/episode-1.webm")
        # The browser decodes it: its length is known and it plays.
        page.wait_for_function("() => document.getElementById('episode-video').duration > 0")
        shoot(page, shots, "watch")

        # Export to ONNX, with its progress bar.
        page.click("#export-run")
        page.wait_for_function("() => document.getElementById('export-progress').value === 1")
        assert "exported to" in page.inner_text("#export-status")
        assert list((run_dir / "studio" / "export-full").glob("*.onnx"))
        shoot(page, shots, "export")

        # A second run, overlaid on the first and smoothed, then deleted.
        fill_form(page, "ppo", {"run.name": "cartpole-b", **PPO_KNOBS, "job.seed": "2"})
        page.fill('[data-path="job.total_timesteps"]', "4096")
        page.click("#start-run")
        page.wait_for_function(
            "() => document.getElementById('run-title').textContent === 'cartpole-b'"
        )
        wait_state(page, "finished")
        page.evaluate("() => rlfleetStudio.openRun('cartpole-a')")
        page.wait_for_selector('#compare-picker option[value="cartpole-b"]', state="attached")
        page.select_option("#compare-picker", ["cartpole-b"])
        page.wait_for_function(
            "() => (rlfleetDashboard.labels('charts/episodic_return') || [])"
            ".includes('cartpole-b: learner')"
        )
        label = page.evaluate("() => rlfleetDashboard.labels('charts/episodic_return')[0]")
        raw = page.evaluate(f"() => rlfleetDashboard.drawn('charts/episodic_return', '{label}')")
        page.eval_on_selector(
            "#smoothing", "e => { e.value = '0.9'; e.dispatchEvent(new Event('input')); }"
        )
        smoothed = page.evaluate(
            f"() => rlfleetDashboard.drawn('charts/episodic_return', '{label}')"
        )
        assert len(smoothed) == len(raw) and smoothed != raw
        shoot(page, shots, "compare")
        page.click("#studio-nav button[data-view=runs]")
        page.click('tr[data-run="cartpole-b"] button[data-action=delete]')
        page.wait_for_selector('tr[data-run="cartpole-b"]', state="detached")
        assert not (workdir / "runs" / "cartpole-b").exists()
        assert page.get_attribute('tr[data-run="cartpole-a"]', "data-state") == "finished"
        shoot(page, shots, "runs")


def test_a_language_model_run_from_the_form_trains_answers_exports_and_serves(
    tmp_path: Path, studios: list[Studio]
) -> None:
    """A new user's GRPO run with the form's defaults (the model is created at the default
    path on first use), shrunk to two updates on the transformers engine."""
    sync_playwright = playwright_or_skip()
    from openai import OpenAI

    workdir = tmp_path / "work"
    workdir.mkdir()
    run_dir = workdir / "runs" / "tiny-lm"
    shots = tmp_path / "screenshots"
    shots.mkdir()
    studio = Studio(workdir)
    studios.append(studio)
    with runs_stopped(workdir), browser_page(sync_playwright) as page:
        page.goto(studio.url)
        page.wait_for_selector("#view-runs:not([hidden])")
        fill_form(page, "grpo", {"run.name": "tiny-lm", **LM_KNOBS})
        page.click("#validate-run")
        page.wait_for_selector("#run-issues li.ok")
        shoot(page, shots, "new-lm-run")
        page.click("#start-run")
        page.wait_for_selector("#run-panel:not([hidden])")
        try:
            wait_state(page, "finished")
        except Exception:
            print(diagnostics(workdir))
            raise
        assert (run_dir / "final" / "config.json").is_file()

        page.wait_for_selector("#watch-prompt:not([hidden])")
        page.wait_for_selector("#eval-samples li pre")
        assert "score" in page.inner_text("#eval-samples")
        page.fill("#prompt-box", "1 + 2 =")
        page.click("#ask-model")
        page.wait_for_selector("#answers dd.answer")
        assert "final" in page.inner_text("#ask-status")
        greedy = page.inner_text('#answers dd[data-mode="greedy"]')
        again = subprocess.run(
            [sys.executable, "-m", "launch", "ask", str(run_dir), "1 + 2 =", "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(again.stdout.strip().splitlines()[-1])["greedy"] == greedy.strip()

        page.click("#export-run")
        page.wait_for_selector("#serve-box:not([hidden])")
        assert (run_dir / "studio" / "export-full" / "config.json").is_file()
        page.select_option("#serve-engine", "hf")
        page.click("#serve-export")
        page.wait_for_selector("#serve-snippet:not([hidden])")
        base_url = page.get_attribute("#serve-status", "data-base-url")
        assert base_url and base_url in page.inner_text("#serve-snippet")
        shoot(page, shots, "serve")
        client = OpenAI(base_url=base_url, api_key="unused")
        reply = client.chat.completions.create(
            model="tiny-lm", messages=[{"role": "user", "content": "1 + 2 ="}], max_tokens=8
        )
        assert reply.choices[0].message.content is not None
