"""A game that owns its loop trains a real PPO learner through GameLinkService.

The game is `play` below: a process stepping its own CartPoles (8 agents of one link) through
the Python SDK (clients/game_link.py), lock step. The env server (game_link enabled,
policy: learner) and the DeepSpeed learner run as `rlfleet serve` processes on a real NATS; the
learner gets the game's spaces from the env server once the game has said Hello.

Halfway the game is SIGKILLed and started again with the same session key, within the resume
window: the link resumes (one link id, one fragment sequence), the new process starts new
episodes, so the server ends the old ones truncated at their last complete transition. The
run must still reach the return threshold, and the ledger must show nothing lost or doubled:
every published fragment id once, sequences without gaps, nothing applied twice or unpublished.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from services.bus import Bus, events_subject, stream_name, traj_subject
from services.ports import free_port
from services.server import wait_for_health

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.asyncio(loop_scope="session"),
]

REPO = Path(__file__).resolve().parents[2]
ENV_ID = "CartPoleGame-v0"
AGENTS = 8
TARGET = 120.0  # mean return of the last 20 episodes; random play scores about 22
WINDOW_S = 20.0


def play(session_key: str, seed: int) -> None:
    """The game: AGENTS CartPoles stepped by this process, actions from the run's policy."""
    import gymnasium as gym
    import numpy as np

    from clients.game_link import GameLink

    envs = [gym.make("CartPole-v1") for _ in range(AGENTS)]
    link = GameLink(
        game="cartpole-python",
        env_id=ENV_ID,
        observation_space=envs[0].observation_space,
        action_space=envs[0].action_space,
        num_agents=AGENTS,
        session_key=session_key,
    )
    print(f"linked {link.link_id} resumed={link.resumed} last_tick={link.last_tick}", flush=True)
    # Episode ids new to the link even after a restart: a clock-based base per process.
    episodes = np.arange(AGENTS, dtype=np.int64) + time.time_ns() // 1000 * AGENTS
    obs = np.stack([env.reset(seed=seed + k)[0] for k, env in enumerate(envs)])
    rewards = np.zeros(AGENTS, np.float32)
    terminated, truncated = np.zeros(AGENTS, bool), np.zeros(AGENTS, bool)
    while True:
        actions = link.act(obs, rewards, terminated, truncated, episodes)
        for k, env in enumerate(envs):
            if terminated[k] or truncated[k]:  # the episode ended last tick: a new one starts
                obs[k] = env.reset()[0]
                rewards[k], terminated[k], truncated[k] = 0.0, False, False
                episodes[k] += AGENTS
                continue
            obs[k], rewards[k], terminated[k], truncated[k], _ = env.step(int(actions[k]))


def _env() -> dict[str, str]:
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in dist}, "OMP_NUM_THREADS": "1"}


async def _serve(kind: str, config: Path, run: str, run_dir: Path, nats: str, port: int) -> Any:
    log = (run_dir / f"{kind}.log").open("ab")
    env = {
        **_env(),
        "RLFLEET_RUN_NAME": run,
        "RLFLEET_RUN_DIR": str(run_dir),
        "RLFLEET_NATS_URL": nats,
    }
    name = "env-0" if kind == "env_server" else "learner"
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "launch.cli", "serve", kind, "--config", str(config)),
        *("--name", name, "--port", str(port)),
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


async def _game(address: str, key: str, seed: int, log: Path) -> Any:
    code = f"from tests.integration.test_game_link_ppo import play; play({key!r}, {seed})"
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        cwd=REPO,
        env={**_env(), "RLFLEET_GAME_LINK_ADDRESS": address},
        stdout=log.open("ab"),
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    entries = []
    with contextlib.suppress(FileNotFoundError):
        for line in (run_dir / "learner" / "applied.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
    return entries


async def _until(what: str, condition: Any, procs: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for proc in procs:
            assert proc.returncode is None, (
                f"a process ended (exit {proc.returncode}) before {what}"
            )
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g}s"
        await asyncio.sleep(0.5)


async def test_game_trains_ppo_and_survives_a_restart(nats_url: str, tmp_path: Path) -> None:
    run = f"itest-gl-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env_port, learner_port = free_port(), free_port()
    address = f"127.0.0.1:{env_port}"
    links = {
        "enabled": True,
        "policy": "learner",
        "learner": f"127.0.0.1:{learner_port}",
        "rollout_length": 32,
        "fragments_per_version": 1,  # paced one update ahead of the learner, like actors
        "resume_window_s": WINDOW_S,
    }
    learner = {
        "env_id": ENV_ID,
        "env_servers": [address],
        "total_timesteps": 400_000,
        "target_return": TARGET,
        "fragments_per_update": 1,  # 32 x 8 = 256 transitions per update
        "update_epochs": 20,
        "minibatch_size": 256,
        "learning_rate": 0.002,
        "gamma": 0.98,
        "gae_lambda": 0.8,
        "ent_coef": 0.0,
        "clip_vloss": False,
        "max_policy_lag": 2,
        "seed": 1,
        "device": "cpu",
    }
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": run, "dir": str(run_dir)},
                "services": [
                    {
                        "name": "env-0",
                        "service": "env_server",
                        "settings": {"game_link": links},
                    },
                    {"name": "learner", "service": "learner", "settings": learner},
                ],
            }
        )
    )
    published: list[Any] = []
    truncated_episodes = collections.Counter[str]()
    key = uuid.uuid4().hex
    procs: list[Any] = []
    truncations: collections.Counter[str] = collections.Counter()
    async with Bus.connect(nats_url, name="test-game-link") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        fragments = await bus.subscribe(traj_subject(run), trajectory_pb2.RolloutFragment)
        episodes = await bus.subscribe(events_subject(run, "episodes"), events_pb2.EpisodeStats)

        async def collect() -> None:
            async with fragments:
                async for delivery in fragments:
                    published.append(delivery.message)

        async def count_truncations() -> None:
            async with episodes:
                async for delivery in episodes:
                    if delivery.message.truncated:
                        truncated_episodes[delivery.message.source] += 1

        watchers = [asyncio.create_task(collect()), asyncio.create_task(count_truncations())]
        try:
            env_server = await _serve("env_server", config, run, run_dir, nats_url, env_port)
            learner_proc = await _serve("learner", config, run, run_dir, nats_url, learner_port)
            procs += [env_server, learner_proc]
            await asyncio.to_thread(wait_for_health, address, 60)
            game_log = run_dir / "game.log"
            game = await _game(address, key, 0, game_log)
            procs.append(game)
            await _until("10 updates", lambda: len(_ledger(run_dir)) >= 10, procs, 150)

            game.send_signal(signal.SIGKILL)  # mid-episode, replies in flight
            await game.wait()
            procs.remove(game)
            killed_at = len(published)
            game = await _game(address, key, 100, game_log)
            procs.append(game)

            others = [env_server, game]
            await _until("the run's end", lambda: learner_proc.returncode is not None, others, 200)
            assert learner_proc.returncode == 0
            procs.remove(learner_proc)
            truncations = truncated_episodes.copy()  # before the env server's stop ends more
        except BaseException:
            for name in ("env_server.log", "learner.log", "game.log"):
                with contextlib.suppress(FileNotFoundError):
                    print(
                        f"--- {name}:\n"
                        + "\n".join((run_dir / name).read_text().splitlines()[-40:])
                    )
            raise
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
            await asyncio.sleep(0.5)
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    learner_log = (run_dir / "learner.log").read_text()
    assert "reached target_return" in learner_log, learner_log[-3000:]
    lines = (run_dir / "game.log").read_text().splitlines()
    linked = [line for line in lines if line.startswith("linked ")]
    assert len(linked) == 2 and "resumed=False" in linked[0] and "resumed=True" in linked[1]
    assert linked[0].split()[1] == linked[1].split()[1]  # the same link id

    # Nothing doubled or lost: one link, one sequence without gaps, every id once.
    assert killed_at < len(published), (killed_at, len(published))
    ids = [f.fragment_id for f in published]
    assert len(ids) == len(set(ids))
    assert {f.actor_id for f in published} == {published[0].actor_id}
    sequences = sorted(f.sequence for f in published)
    assert sequences == list(range(len(published))), sequences
    full = [f for f in published if (f.num_steps, f.num_envs) == (32, AGENTS)]
    assert len(full) >= len(published) - AGENTS, [(f.num_steps, f.num_envs) for f in published]
    # The old process's open episodes were ended truncated: one per agent, except an agent
    # killed on its episode's first tick (no complete transition: nothing to end).
    assert truncations[published[0].actor_id] >= AGENTS // 2, truncations
    entries = [e for e in _ledger(run_dir) if e.get("id")]
    counts = collections.Counter(e["id"] for e in entries)
    assert max(counts.values()) == 1, counts.most_common(3)
    assert set(counts) <= set(ids), set(counts) - set(ids)
