"""The Prometheus series the autoscalers, the Grafana dashboard and the alert rules in deploy/
read: the learners' training gauges (learner/prometheus.py, set where a learner reports its
scalars), the game actor's env-wait histogram (sampler/actors/sampling.py) and the reward
service's Score latency (reward_service/servicer.py). Each is read back from the process's
registry as Prometheus would scrape it. The same gauges from a real learner's /metrics after
real updates: tests/integration/test_learner_prometheus.py."""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from learner.lm.dpo_service import BusReporter
from learner.prometheus import EXPORTED
from learner.workload import Progress, RunDirs, RunHandle
from sampler.actors.sampling import DoubleBuffer, fill_lock_step


def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the default registry, as the /metrics text gives it."""
    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def of_run(run: str) -> dict[str, float]:
    return {name: v for (name, labels), v in scraped().items() if ("run", run) in labels}


class Writer:
    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        pass


class Bus:
    async def publish_event(self, subject: str, message: Any) -> None:
        pass


def run_handle(tmp_path: Path, run: str, progress: Progress) -> RunHandle:
    return RunHandle(
        run_name=run,
        source="learner",
        progress=progress,
        bus=Bus(),  # type: ignore[arg-type]
        dirs=RunDirs.of(tmp_path),
        writer=Writer(),
        tensorboard_step=lambda p: p.samples,
    )


# What the game learner reports after an update (learner/game/workload.py, update.py).
GAME_UPDATE = {
    "charts/episodic_return": 212.5,
    "charts/episodic_length": 212.5,
    "charts/SPS": 1500.0,
    "losses/policy_loss": -0.02,
    "losses/value_loss": 3.5,
    "losses/loss": 1.7,
    "losses/entropy": 0.6,
    "losses/approx_kl": 0.004,
    "charts/policy_lag": 0.5,
    "losses/nonfinite_updates": 0.0,
    "charts/update_s": 0.25,
    "losses/clipfrac": 0.1,  # not exported: no gauge maps it
}


async def test_a_learners_report_sets_its_runs_gauges(tmp_path: Path) -> None:
    run = f"t-{uuid.uuid4().hex[:8]}"
    progress = Progress(updates=7, version=7, samples=4096)
    await run_handle(tmp_path, run, progress).report(GAME_UPDATE)
    got = of_run(run)
    assert got["rlfleet_learner_episodic_return"] == 212.5
    assert got["rlfleet_learner_episodic_length"] == 212.5
    assert got["rlfleet_learner_env_steps_per_second"] == 1500.0
    assert got["rlfleet_learner_policy_loss"] == -0.02
    assert got["rlfleet_learner_value_loss"] == 3.5
    assert got["rlfleet_learner_loss"] == 1.7
    assert got["rlfleet_learner_entropy"] == 0.6
    assert got["rlfleet_learner_approx_kl"] == 0.004
    assert got["rlfleet_learner_policy_lag"] == 0.5
    assert got["rlfleet_learner_nonfinite_updates"] == 0.0
    assert got["rlfleet_learner_update_seconds"] == 0.25
    assert (got["rlfleet_learner_updates"], got["rlfleet_learner_policy_version"]) == (7, 7)
    assert not any("clipfrac" in name for name in got)
    # Another run's gauges are its own.
    assert of_run(f"t-{uuid.uuid4().hex[:8]}") == {}


async def test_a_nonfinite_update_counts_and_leaves_the_last_finite_loss(tmp_path: Path) -> None:
    run = f"t-{uuid.uuid4().hex[:8]}"
    progress = Progress(updates=3, version=3)
    handle = run_handle(tmp_path, run, progress)
    await handle.report({"losses/loss": 0.5, "losses/nonfinite_updates": 0.0})
    # A skipped update (learner/loop.py _skip_nonfinite): the loss is NaN, the count rises.
    await handle.report({"losses/loss": math.nan, "losses/nonfinite_updates": 1.0})
    got = of_run(run)
    assert got["rlfleet_learner_loss"] == 0.5
    assert got["rlfleet_learner_nonfinite_updates"] == 1.0


async def test_lm_learner_keys_share_the_game_learners_gauges(tmp_path: Path) -> None:
    run = f"t-{uuid.uuid4().hex[:8]}"
    progress = Progress(updates=2, version=2)
    await run_handle(tmp_path, run, progress).report(
        {
            "charts/entropy": 1.25,  # the LM learner's name for what the game's losses/entropy is
            "charts/train_tokens_per_s": 900.0,
            "losses/kl": 0.01,
            "reward/total": 0.75,
            "eval/accuracy": 0.5,
        }
    )
    got = of_run(run)
    assert got["rlfleet_learner_entropy"] == 1.25
    assert got["rlfleet_learner_tokens_per_second"] == 900.0
    assert got["rlfleet_learner_reference_kl"] == 0.01
    assert got["rlfleet_learner_reward"] == 0.75
    assert got["rlfleet_learner_eval_accuracy"] == 0.5


def test_the_dpo_learners_progress_sets_its_gauges() -> None:
    run = f"t-{uuid.uuid4().hex[:8]}"
    announcer = SimpleNamespace(
        ctx=SimpleNamespace(run_name=run, name="dpo"),
        count=lambda *args: None,
        publish=lambda *args: None,
    )
    reporter = BusReporter(announcer)  # type: ignore[arg-type]
    row = {"loss": 0.6, "rewards/accuracies": 0.75, "rewards/margins": 0.2, "tokens/s": 300.0}
    reporter.progress(5, 100, row)
    got = of_run(run)
    assert got["rlfleet_learner_loss"] == 0.6
    assert got["rlfleet_learner_dpo_reward_accuracy"] == 0.75
    assert got["rlfleet_learner_dpo_reward_margin"] == 0.2
    assert got["rlfleet_learner_tokens_per_second"] == 300.0
    assert got["rlfleet_learner_updates"] == 5
    assert "rlfleet_learner_policy_version" not in got  # offline DPO has no policy versions


def test_each_metric_key_maps_to_one_gauge() -> None:
    keys = [key for _, mapped in EXPORTED.values() for key in mapped]
    assert len(keys) == len(set(keys)), "a metric key is mapped to two gauges"


# ---------------------------------------------------------------------------- env wait

STEP_S = 0.02


class SlowEnvs:
    """An EnvGroup whose every step takes STEP_S (an env server busy elsewhere)."""

    num_envs = 2
    parts = [slice(0, 1), slice(1, 2)]

    async def step(self, actions: Any, obs: Any, out: Any, part: int = 0) -> Any:
        await asyncio.sleep(STEP_S)
        return None


class Rows:
    """A Rollout of ``rows`` rows per part: what the samplers read and write of it."""

    parts = SlowEnvs.parts

    def __init__(self, rows: int) -> None:
        self.rows, self.done = rows, [0, 0]
        self.current_obs = np.zeros((2, 1), np.float32)

    @property
    def full(self) -> bool:
        return min(self.done) >= self.rows

    def part_full(self, part: int) -> bool:
        return self.done[part] >= self.rows

    def row_obs(self, part: int) -> np.ndarray:
        return self.current_obs

    def record(self, decision: Any, part: int = 0) -> None:
        return None

    def finish(self, events: Any, part: int | None = None) -> None:
        for p in (0, 1) if part is None else (part,):
            self.done[p] += 1


class Zeros:
    def act(self, obs: np.ndarray) -> Any:
        return SimpleNamespace(env_actions=np.zeros(len(obs), np.int64))


async def never(events: Any, steps: int) -> bool:
    return False


def env_wait() -> tuple[float, float]:
    count = prometheus_client.REGISTRY.get_sample_value("rlfleet_actor_env_wait_seconds_count")
    total = prometheus_client.REGISTRY.get_sample_value("rlfleet_actor_env_wait_seconds_sum")
    return count or 0.0, total or 0.0


@pytest.mark.parametrize("double", [False, True])
async def test_an_actor_observes_each_step_it_waits_for(double: bool) -> None:
    count, total = env_wait()
    rollout = Rows(3)
    if double:
        await DoubleBuffer([Zeros(), Zeros()], rollout, SlowEnvs()).fill(never)  # type: ignore[arg-type,list-item]
    else:
        await fill_lock_step(Zeros(), rollout, SlowEnvs(), never)  # type: ignore[arg-type]
    after_count, after_total = env_wait()
    steps = 6 if double else 3  # one observation per part step; lock step: per tick
    assert after_count - count == steps
    # Double-buffered, part 1's step runs while part 0's is awaited: less than a whole step
    # each; lock step waits the whole of each.
    assert after_total - total >= (3 if double else steps) * STEP_S * 0.9


# ---------------------------------------------------------------------------- reward latency


async def test_score_calls_are_timed_by_server() -> None:
    from reward_service.service import build_registry
    from reward_service.servicer import RewardService
    from reward_service.settings import RewardSettings
    from rlfleet.reward.v1 import reward_pb2

    name = f"reward-{uuid.uuid4().hex[:8]}"
    settings = RewardSettings()
    registry, _ = build_registry(settings, entry_points=())
    service = RewardService(registry, settings, name=name)
    try:
        request = reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreItem(prompt="2+2", completion="<answer>4</answer>")],
            rewards=[reward_pb2.RewardWeight(name="format", weight=1.0)],
        )
        context = SimpleNamespace(time_remaining=lambda: None)
        for _ in range(2):
            await service.Score(request, context)  # type: ignore[arg-type]
    finally:
        service.close()
    labels = {"server": name}
    assert (
        prometheus_client.REGISTRY.get_sample_value("rlfleet_reward_score_seconds_count", labels)
        == 2
    )
    seconds = prometheus_client.REGISTRY.get_sample_value(
        "rlfleet_reward_score_seconds_sum", labels
    )
    assert seconds is not None and seconds > 0
