"""The `learner` service as `rlfleet serve learner` runs it, on a real NATS: it trains on the
fragments of the run's stream, survives a SIGKILL without losing or repeating a fragment,
checkpoints on SIGTERM, continues the version numbering, and finishes with the final policy and
RunStatus DONE."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from common import tensor
from common.policies import PolicyConfig, build_policy
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from rlfleet.common.v1 import tensor_pb2
from rlfleet.learner.v1 import learner_pb2, learner_pb2_grpc
from services.bus import Bus, events_subject, stream_name, traj_subject
from services.ports import free_port
from services.server import channel

pytestmark = [
    pytest.mark.slow,  # DeepSpeed learner services: not in `make test-fast`
    pytest.mark.timeout(300),
    pytest.mark.asyncio(loop_scope="session"),
]

T, N = 16, 2
FRAGMENTS = 20  # 10 updates of 2 fragments
REPO = Path(__file__).resolve().parents[2]


def _tree(array: np.ndarray) -> tensor_pb2.TensorTree:
    return tensor_pb2.TensorTree(tensor=tensor.encode(array))


def fragment(run: str, seq: int, version: int) -> trajectory_pb2.RolloutFragment:
    rng = np.random.default_rng(seq)
    truncated = np.zeros((T, N), bool)
    truncated[T // 2, 0] = True
    return trajectory_pb2.RolloutFragment(
        run=run,
        actor_id="actor-0",
        fragment_id=f"{run}/actor-0/inc/{seq}",
        sequence=seq,
        policy_version=version,
        num_steps=T,
        num_envs=N,
        observations=_tree(rng.normal(size=(T, N, 4)).astype(np.float32)),
        actions=_tree(rng.integers(0, 2, size=(T, N)).astype(np.int64)),
        logprobs=tensor.encode(np.full((T, N), math.log(0.5), np.float32)),
        values=tensor.encode(np.zeros((T, N), np.float32)),
        rewards=tensor.encode(np.ones((T, N), np.float32)),
        terminated=tensor.encode(np.zeros((T, N), bool)),
        truncated=tensor.encode(truncated),
        next_observations=_tree(rng.normal(size=(N, 4)).astype(np.float32)),
        bootstrap_values=tensor.encode(np.zeros(N, np.float32)),
        final_indices=tensor.encode(np.array([(T // 2) * N], np.int64)),
        final_observations=_tree(rng.normal(size=(1, 4)).astype(np.float32)),
        final_values=tensor.encode(np.zeros(1, np.float32)),
    )


class Watcher:
    """Collects the run's learner events."""

    def __init__(self) -> None:
        self.metrics: list[events_pb2.Metrics] = []
        self.weights: list[events_pb2.WeightsPublished] = []
        self.status: list[events_pb2.RunStatus] = []

    async def watch(self, bus: Bus, run: str) -> list[asyncio.Task[None]]:
        async def collect(kind: str, message_type: Any, into: list[Any]) -> None:
            async with await bus.subscribe(events_subject(run, kind), message_type) as sub:
                async for delivery in sub:
                    into.append(delivery.message)

        return [
            asyncio.create_task(collect("metrics", events_pb2.Metrics, self.metrics)),
            asyncio.create_task(collect("weights", events_pb2.WeightsPublished, self.weights)),
            asyncio.create_task(collect("status", events_pb2.RunStatus, self.status)),
        ]


async def until(condition: Any, timeout_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def learner_run(
    tmp_path: Path, prefix: str, fragments: int, **overrides: Any
) -> tuple[str, Path, Path]:
    """(run name, run dir, run file) of a run of the learner alone on CartPole-v1's spaces that
    ends after ``fragments`` fragments of the test's (2 per update); ``overrides`` change its
    settings."""
    run = f"{prefix}-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    settings = {
        "env_id": "CartPole-v1",
        "policy": {"hidden_sizes": [16, 16]},
        "total_timesteps": fragments * T * N,
        "fragments_per_update": 2,
        "update_epochs": 1,
        "minibatch_size": 32,
        "max_policy_lag": 1000,
        "device": "cpu",
        **overrides,
    }
    config = tmp_path / "run.yaml"
    service = {"name": "learner", "service": "learner", "settings": settings}
    config.write_text(
        yaml.safe_dump({"run": {"name": run, "dir": str(run_dir)}, "services": [service]})
    )
    return run, run_dir, config


async def start_learner(config: Path, run: str, run_dir: Path, nats_url: str, port: int) -> Any:
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # not a launcher's
    env = {
        **{k: v for k, v in os.environ.items() if k not in dist},
        "RLFLEET_RUN_NAME": run,
        "RLFLEET_RUN_DIR": str(run_dir),
        "RLFLEET_NATS_URL": nats_url,
        "OMP_NUM_THREADS": "1",
    }
    log = (run_dir / "learner.log").open("ab")
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "launch.cli",
        "serve",
        "learner",
        "--config",
        str(config),
        "--name",
        "learner",
        "--port",
        str(port),
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=log,
    )


async def test_learner_crash_and_restart_applies_every_fragment_once(
    nats_url: str, tmp_path: Path
) -> None:
    run, run_dir, config = learner_run(
        tmp_path, "itest-lrn", FRAGMENTS, checkpoint_every=3, ack_wait_s=3.0
    )
    port = free_port()
    watcher = Watcher()
    async with Bus.connect(nats_url, name="test-learner-service") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        tasks = await watcher.watch(bus, run)
        learner = await start_learner(config, run, run_dir, nats_url, port)
        try:
            # Phase 1: 10 fragments = 5 updates; the checkpoint at update 3 covers 6 of them.
            await until(lambda: watcher.weights)  # version 0 is out: the learner is ready
            for seq in range(10):
                await bus.publish(traj_subject(run), fragment(run, seq, 0), msg_id=f"{run}/{seq}")
            await until(lambda: any(m.step == 5 for m in watcher.metrics))
            async with channel(f"127.0.0.1:{port}") as ch:
                status = await learner_pb2_grpc.LearnerServiceStub(ch).GetStatus(
                    learner_pb2.GetStatusRequest(), timeout=10
                )
            assert (status.updates, status.messages_consumed, status.policy_version) == (5, 10, 5)
            assert status.samples_consumed == 10 * T * N and "losses/policy_loss" in status.metrics
            # Each version tells what it took of each producer (the actors' flow control).
            taken = {w.version: dict(w.taken_sequences) for w in watcher.weights}
            assert taken[0] == {} and taken[5] == {f"{run}/actor-0/inc": 9}
            learner.send_signal(signal.SIGKILL)  # updates 4 and 5 are lost with the process
            assert await learner.wait() == -signal.SIGKILL
            versions_before = max(w.version for w in watcher.weights)

            # Phase 2: restart; the 4 unacked fragments come back. SIGTERM after update 7: the
            # learner checkpoints what it applied before it exits.
            learner = await start_learner(config, run, run_dir, nats_url, port)
            for seq in range(10, 14):
                await bus.publish(traj_subject(run), fragment(run, seq, 0), msg_id=f"{run}/{seq}")
            await until(lambda: any(m.step == 7 for m in watcher.metrics))
            learner.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(learner.wait(), 60) == 0
            assert (run_dir / "checkpoints/latest").read_text().strip() == "update-00000007"

            # Phase 3: the rest, to the end.
            learner = await start_learner(config, run, run_dir, nats_url, port)
            for seq in range(14, FRAGMENTS):
                await bus.publish(traj_subject(run), fragment(run, seq, 0), msg_id=f"{run}/{seq}")
            assert await asyncio.wait_for(learner.wait(), 240) == 0
            await until(lambda: watcher.status)
        finally:
            if learner.returncode is None:
                learner.kill()
                await learner.wait()
            for task in tasks:
                task.cancel()

    # Versions continue after the highest one published before the crash.
    after = [w.version for w in watcher.weights if w.version > versions_before]
    assert after and min(after) == versions_before + 1
    assert sorted(w.version for w in watcher.weights) == [w.version for w in watcher.weights]

    ledger = [
        json.loads(line) for line in (run_dir / "learner/applied.jsonl").read_text().splitlines()
    ]
    applied = [e["id"] for e in ledger if e["status"] == "applied"]
    assert sorted(applied) == sorted(f"{run}/actor-0/inc/{seq}" for seq in range(FRAGMENTS))
    assert [e["update"] for e in ledger if e["status"] == "applied"] == [
        u for u in range(1, FRAGMENTS // 2 + 1) for _ in range(2)
    ]

    assert watcher.status[-1].state == events_pb2.RUN_STATE_DONE
    last = watcher.metrics[-1]
    assert last.step == FRAGMENTS // 2 and last.scalars["charts/global_step"] == FRAGMENTS * T * N
    for key in ("charts/SPS", "charts/policy_lag", "charts/dropped_fragments", "losses/approx_kl"):
        assert key in last.scalars

    final = json.loads((run_dir / "final/policy.json").read_text())
    assert final["env_id"] == "CartPole-v1" and final["global_step"] == FRAGMENTS * T * N
    env = gym.make("CartPole-v1")
    config = PolicyConfig(hidden_sizes=(16, 16))
    policy = build_policy(env.observation_space, env.action_space, config)
    policy.load_state_dict(torch.load(run_dir / "final/policy.pt"))
    assert (run_dir / "checkpoints/latest").read_text().strip() == f"update-{FRAGMENTS // 2:08d}"
    assert list((run_dir / "tensorboard").iterdir())


async def test_nan_fragments_never_train_and_a_few_updates_of_them_fail_the_run(
    nats_url: str, tmp_path: Path
) -> None:
    """The probe's case: an actor's fragments turn NaN. Their updates are skipped (counted, NaN
    losses reported, no version, messages dropped), the weights stay finite, and the second in
    a row (max_nonfinite_updates: 2) fails the learner permanently, in one line naming them."""
    run, run_dir, config = learner_run(tmp_path, "itest-nan", 100, max_nonfinite_updates=2)

    def poisoned(seq: int) -> trajectory_pb2.RolloutFragment:
        msg = fragment(run, seq, 0)
        obs = tensor.decode_tree(msg.observations).copy()
        obs[3, 1, 2] = np.nan
        msg.observations.CopyFrom(_tree(obs))
        return msg

    watcher = Watcher()
    async with Bus.connect(nats_url, name="test-learner-nan") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        tasks = await watcher.watch(bus, run)
        learner = await start_learner(config, run, run_dir, nats_url, free_port())
        try:
            await until(lambda: watcher.weights)  # version 0
            for seq, msg in enumerate(
                [fragment(run, 0, 0), fragment(run, 1, 0), fragment(run, 2, 0), poisoned(3)]
            ):
                await bus.publish(traj_subject(run), msg, msg_id=f"{run}/{seq}")
            skipped = "losses/nonfinite_updates"
            # The update of fragments 2 and 3 is skipped, and reported.
            await until(lambda: any(m.scalars.get(skipped) == 1 for m in watcher.metrics))
            await bus.publish(traj_subject(run), poisoned(4), msg_id=f"{run}/4")
            await bus.publish(traj_subject(run), fragment(run, 5, 0), msg_id=f"{run}/5")
            assert await asyncio.wait_for(learner.wait(), 120) == 3  # EXIT_PERMANENT
        finally:
            if learner.returncode is None:
                learner.kill()
                await learner.wait()
            await asyncio.sleep(0.2)  # the last events reach the subscriptions
            for task in tasks:
                task.cancel()

    # Update 1 (fragments 0, 1) was applied and published; none after it.
    assert [w.version for w in watcher.weights] == [0, 1]
    first, nan_update = watcher.metrics[0], watcher.metrics[1]
    assert first.scalars["losses/nonfinite_updates"] == 0
    assert nan_update.scalars["losses/nonfinite_updates"] == 1 and nan_update.step == 1
    ledger = [
        json.loads(line) for line in (run_dir / "learner/applied.jsonl").read_text().splitlines()
    ]
    assert [(e["id"].rsplit("/", 1)[1], e["status"]) for e in ledger] == [
        ("0", "applied"), ("1", "applied"),
        ("2", "nonfinite"), ("3", "nonfinite"), ("4", "nonfinite"), ("5", "nonfinite"),
    ]  # fmt: skip
    lines = (run_dir / "learner.log").read_text().splitlines()
    [reason] = [line for line in lines if "permanent failure" in line]
    assert reason.startswith("rlfleet: permanent failure: learner (learner): NonfiniteUpdate: 2 ")
    assert f"actor-0 (fragment {run}/actor-0/inc/4): NaN/inf in observations" in reason
    # What the learner checkpointed on its way out is update 1's weights: finite.
    states = torch.load(
        run_dir / "checkpoints/update-00000001/mp_rank_00_model_states.pt", weights_only=False
    )
    assert all(torch.isfinite(v).all() for v in states["module"].values())
