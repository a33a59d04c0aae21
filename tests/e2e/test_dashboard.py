"""End to end: the dashboard of `rlfleet up` in headless Chromium while a short PPO run trains.

`rlfleet up` on (a copy of) examples/cartpole_ppo.yaml with two actors, a 20k-step budget and
RLFLEET_TENSORBOARD=1 (what `--tensorboard` sets); Debian's `chromium`, driven by Playwright's
Python package (its bundled driver, no browser download), opens the printed URL and checks that
the page loads, that every service shows healthy (gRPC services) or running, that an episodic
return curve exists and gains points while the run trains, and that the losses are drawn; that
the x axis counts env steps with compact tick labels and the toggle switches it to wall time,
that the return chart's series say what they are (the learner's first), that the hard-to-read
charts carry help text and that a run without a score metric has no score chart; it saves a
screenshot in the test's tmp dir and prints its path; the run picker then shows an earlier
run's curves (a metrics.jsonl beside the run dir), its score chart among them. TensorBoard
answers on its printed URL, and when the run ends neither it nor the dashboard is left.

Needs /usr/bin/chromium and the playwright package (`make browser-deps` installs both); without
them the test is skipped with that advice, and under CI=true it fails instead.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS, playwright_or_skip
from tests.fixtures.launch import Up, assert_nothing_left

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cartpole_ppo.yaml"
SERVICES = ("env-0", "learner", "actor-0", "actor-1")  # the example's two-actor shape
RUN_TIMEOUT_S = 420.0  # a 20k-step run takes about a minute on 2 idle cores
PAGE_TIMEOUT_MS = 240_000  # waits inside the page: the whole run's start-up on a loaded machine
RETURN_CHART = '.chart[data-key="charts/episodic_return"]'
SCORE_KEY = "charts/episodic_score"  # the earlier run's: a game that reports its score
COMPACT = re.compile(r"^-?\d{1,3}(\.\d{1,3})?[kMGT]?$|^-?\d(\.\d+)?e-\d+$|^-?0\.\d{1,4}$")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
]


def write_config(tmp_path: Path) -> tuple[Path, Path]:
    config = yaml.safe_load(EXAMPLE.read_text())
    run_dir = tmp_path / "run"
    config["run"] = {"name": f"e2e-dash-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)}
    config["job"].update({"total_timesteps": 20_000, "target_return": None, "seed": 1})
    # The example's other shape (same batch): two actors, so the return chart has three lines.
    config["job"].update({"num_actors": 2, "num_envs": 4, "fragments_per_update": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir


def write_earlier_run(tmp_path: Path) -> None:
    """An earlier run beside the run dir: two records, as the launcher writes them."""
    lines = [
        {"time": 1_700_000_000.0 + i, "kind": "metrics", "type": "rlfleet.bus.v1.Metrics",
         "service": "learner", "step": i, "version": i,
         "values": {"charts/episodic_return": 10.0 * i, "charts/global_step": 256.0 * i,
                    SCORE_KEY: float(i)}}
        for i in (1, 2)
    ]  # fmt: skip
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines)
    )


def check_axes_labels_and_help(page: Any) -> None:
    """On the live run: env steps on x (compact ticks), the toggle to wall time and back, the
    return chart's series labels, help texts, and no score chart (CartPole reports none)."""
    key = "charts/episodic_return"
    assert page.evaluate("() => rlfleetDashboard.xMode()") == "steps"
    # Thousands of env steps once the run is past its first updates (a loaded machine may still
    # be in the hundreds when the curve first grows).
    page.wait_for_function(
        f"() => rlfleetDashboard.axes('{key}').x.some(label => label.endsWith('k'))"
    )
    axes = page.evaluate(f"() => rlfleetDashboard.axes('{key}')")
    assert axes["xTime"] is False
    # The tick labels uPlot drew on the canvas: short, no lost digits.
    for label in axes["x"] + axes["y"]:
        assert COMPACT.match(label), (label, axes)
    formatted = page.evaluate(
        """() => [[12000, 1000], [3400000, 100000], [2500, 2500], [0.25, 0.05],
                  [0.00015, 0.00005], [0.0015, 0.0005], [475, 25], [0, 0.1], [1234567]]
                 .map(([v, incr]) => rlfleetDashboard.formatTick(v, incr))"""
    )
    assert formatted == ["12k", "3.4M", "2.5k", "0.25", "1.5e-4", "0.0015", "475", "0", "1.23M"]

    # The learner's line comes with its first mean return, maybe after the actors' lines.
    page.wait_for_function(f"() => rlfleetDashboard.labels('{key}')?.length === 3")
    labels = page.evaluate(f"() => rlfleetDashboard.labels('{key}')")
    assert labels[0] == "learner (all actors, recent episodes)", labels
    assert sorted(labels[1:]) == [
        "actor-0 (its own recent episodes)",
        "actor-1 (its own recent episodes)",
    ], labels

    for chart, words in (
        ("charts/episodic_return", "learner"),
        ("charts/dropped_fragments", "max_policy_lag"),
        ("charts/update_s", "Seconds per learner update"),
        ("losses/clipfrac", "importance ratio"),
        ("losses/ratio_mean", "importance ratio"),
    ):
        help_text = page.locator(f'.chart[data-key="{chart}"] .help').inner_text()
        assert words in help_text, (chart, help_text)
    keys = page.eval_on_selector_all(".chart", "bs => bs.map(b => b.dataset.key)")
    assert not [k for k in keys if k.endswith("score")], keys

    page.check('input[name="x-axis"][value="time"]')
    assert page.evaluate("() => rlfleetDashboard.xMode()") == "time"
    assert page.evaluate(f"() => rlfleetDashboard.axes('{key}').xTime") is True
    page.check('input[name="x-axis"][value="steps"]')
    assert page.evaluate(f"() => rlfleetDashboard.axes('{key}').xTime") is False


def wait_http(url: str, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(url, timeout=5)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_dashboard_shows_the_run_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sync_playwright = playwright_or_skip()
    config, run_dir = write_config(tmp_path)
    write_earlier_run(tmp_path)
    monkeypatch.setenv("RLFLEET_TENSORBOARD", "1")
    up = Up(config, run_dir, services=SERVICES, budget_s=RUN_TIMEOUT_S)
    try:
        up.wait_for(r"dashboard at http://127\.0\.0\.1:\d+/", timeout_s=60)
        up.wait_for(r"TensorBoard at http://127\.0\.0\.1:\d+/", timeout_s=60)
        url = re.findall(r"dashboard at (http://127\.0\.0\.1:\d+/)", up.output)[0]
        tensorboard = re.findall(r"TensorBoard at (http://127\.0\.0\.1:\d+/)", up.output)[0]
        # Asked now, while the run lives: TensorBoard stops with the run, which can end during
        # the page's checks on a fast or a loaded machine.
        tensorboard_answer = concurrent.futures.ThreadPoolExecutor(1).submit(
            wait_http, tensorboard, 60
        )

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(PAGE_TIMEOUT_MS)
                page.goto(url)
                assert page.title() == "rlfleet dashboard"

                page.wait_for_function(
                    """(names) => {
                        const rows = [...document.querySelectorAll('#services tbody tr')];
                        const state = Object.fromEntries(
                            rows.map(r => [r.dataset.service, r.dataset.state]));
                        return names.every(n => state[n] === 'healthy' || state[n] === 'running')
                            && state['learner'] === 'healthy' && state['env-0'] === 'healthy';
                    }""",
                    arg=list(SERVICES),
                )
                states = page.eval_on_selector_all(
                    "#services tbody tr",
                    "rows => rows.map(r => [r.dataset.service, r.dataset.state])",
                )

                # The return curve: drawn, then more points while the run trains.
                page.wait_for_function(
                    f"() => Number(document.querySelector('{RETURN_CHART}')?.dataset.points) > 0"
                )
                chart = page.locator(RETURN_CHART)
                assert chart.locator("canvas").count() >= 1, "no uPlot canvas in the return chart"
                before = int(chart.get_attribute("data-points") or 0)
                page.wait_for_function(
                    f"(n) => Number(document.querySelector('{RETURN_CHART}').dataset.points) > n",
                    arg=before,
                )
                after = int(chart.get_attribute("data-points") or 0)
                for key in (
                    "charts/SPS",
                    "losses/entropy",
                    "losses/approx_kl",
                    "charts/policy_lag",
                ):
                    assert page.locator(f'.chart[data-key="{key}"]').count() == 1, key
                current = page.locator('#run-picker option[value="run"]')
                assert current.inner_text() == "run (current)"
                check_axes_labels_and_help(page)

                screenshot = tmp_path / "dashboard.png"
                page.screenshot(path=str(screenshot), full_page=True)

                page.select_option("#run-picker", "earlier")
                page.wait_for_function(
                    f"() => document.querySelector('{RETURN_CHART}')?.dataset.points === '2'"
                )
                # A run with a score metric has a score chart, next to the return's.
                score = page.locator(f'.chart[data-key="{SCORE_KEY}"]')
                score.wait_for(state="attached")
                assert score.get_attribute("data-points") == "2"
                assert "score" in score.locator(".help").inner_text()
                keys = page.eval_on_selector_all(".chart", "bs => bs.map(b => b.dataset.key)")
                assert keys[:2] == ["charts/episodic_return", SCORE_KEY], keys
                assert page.evaluate(f"() => rlfleetDashboard.axes('{SCORE_KEY}').xTime") is False
                page.locator("#services-note").wait_for(state="visible")  # no services: earlier
                assert page.locator("#services").is_hidden()
            finally:
                browser.close()
        print(f"\ndashboard screenshot: {screenshot}")
        print(f"services {states}; return curve {before} -> {after} points")

        assert tensorboard_answer.result().status_code == 200
        assert up.wait() == 0, "the run failed"
        assert "main service learner finished" in up.output
        assert_nothing_left(run_dir)  # TensorBoard too: its --logdir is in the run dir
        with pytest.raises(httpx.TransportError):
            httpx.get(url, timeout=2)
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
