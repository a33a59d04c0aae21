"""End to end: the C++ GameLink SDK (sdk/cpp) and its Pong game, built and trained.

`make sdk-cpp` installs the toolchain when missing (sdk/cpp/install-deps.sh), configures and
builds sdk/cpp/build and runs its ctest suite: the SDK's unit tests, Pong's rules, and the SDK
against a real env server it starts (lock step, pipelining, in-band errors, resume after a cut
stream, takeover, Goodbye). Then `rlfleet up` runs a shortened copy of examples/pong_cpp.yaml:
env-0 hosting GameLinkService for the learner, game-0 (`build/examples/pong/pong --tables 16`, 16
tables as 16 agents of one link) and the learner, until the mean return of the last 20 episodes
reaches TARGET points. Random play is measured first with the game's own random player (`pong
--local random`, no server): about 0.35 points per episode.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pong_cpp.yaml"
SDK = REPO / "sdk" / "cpp"
PONG = SDK / "build" / "examples" / "pong" / "pong"
SERVICES = ("env-0", "game-0", "learner")
TARGET = 8.0  # points per episode (20x random); the full run file goes on to 18
MAX_STEPS = 150_000  # the target is reached after about 40k steps
# A bound, not the pace: the run ends at the target (or MAX_STEPS). Its learner sets the pace
# (the game plays on with the policy it has), so a loaded machine needs several times the idle
# time to reach the same step: the bound leaves room for that.
RUN_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 1200.0  # a first build compiles the generated gRPC code (minutes on 2 cores)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc; Debian packages"),
]


@pytest.fixture(scope="module")
def sdk_cpp() -> subprocess.CompletedProcess[str]:
    """`make sdk-cpp` (incremental after the first time): its output, with the ctest summary."""
    return subprocess.run(
        ["make", "-s", "sdk-cpp"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def built(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"make sdk-cpp failed:\n{result.stdout[-6000:]}\n{result.stderr}"
    assert PONG.is_file()


def random_score() -> float:
    """Mean points per episode of the game's uniform random player over 500 episodes."""
    played = subprocess.run(
        [str(PONG), "--local", "random", "--episodes", "500", "--tables", "16"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert played.returncode == 0, played.stderr
    return final_mean_score(played.stdout)


def final_mean_score(text: str) -> float:
    scores = re.findall(r"^pong: \d+ episodes, mean score \(last 100\) ([\d.]+)$", text, re.M)
    assert scores, f"no score summary in:\n{text[-3000:]}"
    return float(scores[-1])


def write_config(tmp_path: Path) -> tuple[Path, Path, str]:
    config = yaml.safe_load(EXAMPLE.read_text())
    name = f"e2e-pong-cpp-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    config["run"] = {"name": name, "dir": str(run_dir)}
    config["job"].update(total_timesteps=MAX_STEPS, target_return=TARGET)
    config["job"]["game"]["cwd"] = str(SDK)  # the copy does not sit next to sdk/
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir, name


def episodic_returns(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("charts/episodic_return")]


@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_ctest_suite_passes(sdk_cpp: subprocess.CompletedProcess[str]) -> None:
    built(sdk_cpp)
    out = sdk_cpp.stdout
    assert re.search(r"100% tests passed, 0 tests failed out of 3", out), out[-4000:]
    for suite in ("unit_tests", "pong_tests", "server_tests"):
        assert re.search(rf"Test\s+#\d+: {suite} \.+\s+Passed", out), f"{suite}:\n{out[-4000:]}"


@pytest.mark.timeout(BUILD_TIMEOUT_S + RUN_TIMEOUT_S + 120)
def test_cpp_pong_trains_through_game_link(
    sdk_cpp: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    built(sdk_cpp)
    baseline = random_score()
    assert baseline < TARGET / 5, f"random play scores {baseline}: the target is not well above it"

    config, run_dir, name = write_config(tmp_path)
    up = Up(config, run_dir, services=SERVICES, budget_s=RUN_TIMEOUT_S)
    try:
        assert up.wait() == 0, "the run failed"
        out = up.output
        assert "main service learner finished" in out
        assert re.search(r"game-0\s+process\s+exit 0\s+restarts 0", out), out

        points = episodic_returns(run_dir)
        reached = [(step, value) for step, value in points if value >= TARGET]
        best = max(points, key=lambda p: p[1], default=None)
        assert reached, f"episodic_return never reached {TARGET:g} (best {best}, random {baseline})"
        final = json.loads((run_dir / "final" / "policy.json").read_text())
        assert final["env_id"] == "PongCpp-v0"
        assert final["global_step"] < MAX_STEPS  # ended by the target, not the step budget

        game_log = (run_dir / "logs" / "game-0.log").read_text()
        assert re.search(rf"^pong: link \S+ open, 16 tables, run {name}$", game_log, re.M)
        # Stopped by the launcher, the game said Goodbye and the server counted its ticks.
        assert re.search(r"^pong: farewell: [1-9]\d* ticks, [1-9]\d* episodes$", game_log, re.M)
        assert_nothing_left(run_dir)
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
    step, value = reached[0]
    elapsed = RUN_TIMEOUT_S - up.remaining_s()
    print(f"random {baseline:.2f}; reached {value:.2f} at step {step}; run took {elapsed:.0f}s")
