"""A `process` service under `rlfleet up`: an external command started after the service it
names is healthy, given that service's real address, restarted after a crash, and gone when the
launcher is SIGKILLed; and the PPO job's `game:` block, whose game processes train the learner
through GameLink.

Real processes throughout: `python -m launch.cli up` in a subprocess, the real nats-server, a
real `heartbeat` service, a small Python "game" that checks the heartbeat's gRPC health, and for
the job a Python game of Snake-v0 boards on the Python GameLink SDK with the real learner.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.fixtures.launch import Up, assert_nothing_left, pids_mentioning, write_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="scans /proc")

# argv: run dir, peer address. Crashes on its first start, then reports and waits to be stopped.
GAME = """\
import os, pathlib, sys, time
from services.server import wait_for_health

run_dir, peer = pathlib.Path(sys.argv[1]), sys.argv[2]
with open(run_dir / "game-pids", "a") as out:
    out.write(f"{os.getpid()}\\n")
wait_for_health(peer, 5.0)  # raises unless the heartbeat answers SERVING
crashed = run_dir / "game-crashed"
if not crashed.exists():
    crashed.write_text("once")
    sys.exit(3)
(run_dir / "game-ok").write_text(f"{peer} {os.environ['RUN_NAME_SEEN']} {os.getcwd()}")
while True:
    time.sleep(1)
"""


def test_process_is_supervised_sees_real_addresses_and_dies_with_the_launcher(
    tmp_path: Path,
) -> None:
    (tmp_path / "game.py").write_text(GAME)
    config, run_dir = write_config(
        tmp_path,
        f"""\
        - name: hb
          service: heartbeat
          settings: {{interval_s: 0.5}}
        - name: game
          service: process
          restarts: 2
          settings:
            command: [{sys.executable}, game.py, '{{run_dir}}', '{{address:hb}}']
            env: {{RUN_NAME_SEEN: '{{run}}'}}
        """,
        name="proc",
    )
    up = Up(config, run_dir, services=("hb", "game"), budget_s=60)
    ok = run_dir / "game-ok"
    try:
        up.wait_until("the game's report after its restart", ok.exists)
        peer, run_name, cwd = ok.read_text().split()
        hb_log = (run_dir / "logs" / "hb.log").read_text()
        assert re.search(rf"heartbeat hb serving on {re.escape(peer)}\b", hb_log), (peer, hb_log)
        assert run_name == "proc" and cwd == str(tmp_path)  # cwd: the run file's folder
        assert "game crashed (exit 1); restart 1/2" in up.output
        assert "ended (exit 3)" in (run_dir / "logs" / "game.log").read_text()
        games = [int(p) for p in (run_dir / "game-pids").read_text().split()]
        assert len(games) == 2 and pids_mentioning("game.py", str(run_dir)) == [games[1]]
        up.proc.kill()  # SIGKILL: the launcher runs no cleanup at all
        up.proc.wait(10)
        # The game gets SIGTERM from its supervisor, which gets it from the kernel. (The
        # heartbeat may take a few seconds more: its bus flush times out with NATS gone.)
        deadline = time.monotonic() + 10
        while pids_mentioning("game.py", str(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_mentioning("game.py", str(run_dir)) == [], "the game outlived the launcher"
        while pids_mentioning(str(run_dir)) and time.monotonic() < deadline + 5:
            time.sleep(0.1)
        assert_nothing_left(run_dir)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{up.diagnostics()}") from None
    finally:
        up.stop()


def test_the_command_runs_with_its_environment_and_a_clean_exit_finishes_it(
    tmp_path: Path,
) -> None:
    # A run of only a process service: main, exits 0 -> the run is ok.
    config, run_dir = write_config(
        tmp_path,
        textwrap.dedent(
            """\
            - name: once
              service: process
              main: true
              settings:
                command: [sh, -c, 'echo "hello from $WHO in $RLFLEET_RUN_NAME"']
                env: {WHO: '{run}'}
            """
        ),
        name="once",
    )
    up = Up(config, run_dir, services=("once",), budget_s=30)
    try:
        assert up.wait() == 0, up.diagnostics()
        assert "main service once finished" in up.output
        assert "hello from once in once" in (run_dir / "logs" / "once.log").read_text()
        assert_nothing_left(run_dir)
    finally:
        up.stop()


def test_a_service_runs_on_the_cpus_its_entry_names_and_unknown_cpus_fail_first(
    tmp_path: Path,
) -> None:
    last = sorted(os.sched_getaffinity(0))[-1]
    report = "import os; print('on cpus', sorted(os.sched_getaffinity(0)))"
    entry = f"""\
        - name: pinned
          service: process
          main: true
          cpus: [{{cpus}}]
          settings:
            command: [{sys.executable}, -c, "{report}"]
        """
    config, run_dir = write_config(tmp_path, entry.format(cpus=last), name="pinned")
    up = Up(config, run_dir, services=("pinned",), budget_s=30)
    try:
        assert up.wait() == 0, up.diagnostics()
        assert f"on cpus [{last}]" in (run_dir / "logs" / "pinned.log").read_text()
    finally:
        up.stop()
    bad = tmp_path / "bad"
    bad.mkdir()
    config, run_dir = write_config(bad, entry.format(cpus=4095), name="pinned")
    up = Up(config, run_dir, budget_s=30)
    try:
        assert up.wait() != 0
        assert "services[0] (pinned).cpus: CPU [4095] not available here" in up.output
        assert not (run_dir / "logs" / "pinned.log").exists()  # nothing started
    finally:
        up.stop()


_PRINT_THREADS = """\
import os, pathlib, sys, time

if len(sys.argv) > 1:  # first wait for the other service's line
    log = pathlib.Path(os.environ["RLFLEET_RUN_DIR"]) / "logs" / f"{sys.argv[1]}.log"
    deadline = time.monotonic() + 30
    while "threads" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "no line from " + sys.argv[1]
        time.sleep(0.1)
print("threads", os.environ["OMP_NUM_THREADS"], flush=True)
time.sleep(0 if len(sys.argv) > 1 else 60)
"""


def test_a_service_computes_with_the_threads_its_entry_names(tmp_path: Path) -> None:
    """`threads:` becomes the service's OMP_NUM_THREADS (torch's intra-op pool follows it);
    without it a service gets the launcher's, 1 unless set."""
    script = tmp_path / "threads.py"
    script.write_text(_PRINT_THREADS)
    entry = f"""\
        - name: plain
          service: process
          settings: {{command: [{sys.executable}, {script}]}}
        - name: counted
          service: process
          main: true
          threads: 3
          settings: {{command: [{sys.executable}, {script}, plain]}}
        """
    config, run_dir = write_config(tmp_path, entry, name="threads")
    up = Up(config, run_dir, services=("plain", "counted"), budget_s=60)
    try:
        assert up.wait() == 0, up.diagnostics()
        assert "threads 3\n" in (run_dir / "logs" / "counted.log").read_text()
        assert "threads 1\n" in (run_dir / "logs" / "plain.log").read_text()
    finally:
        up.stop()


# Snake-v0 boards as agents of one link, next-step episode rows (the proto's ObservationBatch).
SNAKE_GAME = """\
import os
import numpy as np
from env_server.envs.snake import SnakeEnv
from clients.game_link import GameLink

n = int(os.environ["BOARDS"])
boards = [SnakeEnv() for _ in range(n)]
obs = np.stack([b.reset(seed=i)[0] for i, b in enumerate(boards)])
rew, term, trunc = np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, bool)
episode = np.arange(n, dtype=np.int64) * 1_000_000
space = boards[0]
link = GameLink(game="snake-py", env_id="Snake-v0", observation_space=space.observation_space,
                action_space=space.action_space, num_agents=n)
while True:
    actions = link.act(obs, rew, term, trunc, episode)
    for i, board in enumerate(boards):
        if term[i] or trunc[i]:
            obs[i], rew[i], term[i], trunc[i] = board.reset()[0], 0.0, False, False
            episode[i] += 1
        else:
            obs[i], rew[i], term[i], trunc[i], _ = board.step(int(actions[i]))
"""


# The run is paced by its learner, which a loaded machine slows several-fold.
GAME_RUN_S = 600


@pytest.mark.slow  # the DeepSpeed learner
@pytest.mark.timeout(GAME_RUN_S + 120)
def test_game_job_trains_the_learner_from_game_processes(tmp_path: Path) -> None:
    (tmp_path / "games").mkdir()
    (tmp_path / "games" / "snake_game.py").write_text(SNAKE_GAME)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run: {{name: game-job, dir: {run_dir}}}\n"
        "job:\n  kind: ppo\n  env_id: Snake-v0\n  rollout_length: 32\n"
        "  total_timesteps: 2048\n  minibatch_size: 128\n  device: cpu\n"
        f"  game: {{command: [{sys.executable}, snake_game.py], cwd: games, instances: 2,\n"
        "         env: {BOARDS: 4}}\n"
    )
    up = Up(config, run_dir, services=("env-0", "game-0", "game-1", "learner"), budget_s=GAME_RUN_S)
    try:
        assert up.wait() == 0, up.diagnostics()
        learner_log = (run_dir / "logs" / "learner.log").read_text()
        # 2 links x 32 ticks x 4 boards = 256 transitions per update: 8 updates for 2048 steps.
        assert "2048 env steps in 8 updates" in up.output, up.diagnostics()
        assert "Traceback" not in learner_log
        for game in ("game-0", "game-1"):
            assert re.search(
                r"pid \d+ ended \(SIGTERM\)", (run_dir / "logs" / f"{game}.log").read_text()
            )
        assert_nothing_left(run_dir)
    finally:
        up.stop()
