"""learner.engine with a real DeepSpeed engine on the CPU: checkpoints resume to identical
losses, named weights are the module's full state_dict (gathered under ZeRO-3), close() cleans
up."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from common.policies import PolicyConfig, build_policy
from learner.engine import Engine, _shm_buffer_path, build_engine
from learner.game.settings import LearnerSettings
from learner.game.update import Fragment, FragmentBatch, update

pytestmark = pytest.mark.slow  # DeepSpeed engines: not in `make test-fast`

OBS_DIM = 4


def settings(zero_stage: int) -> LearnerSettings:
    return LearnerSettings(
        device="cpu", zero_stage=zero_stage, minibatch_size=32, update_epochs=2, learning_rate=3e-3
    )


def make_policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    policy = build_policy(space, gym.spaces.Discrete(2), PolicyConfig(hidden_sizes=(32, 32)))
    policy.forward = policy.evaluate  # type: ignore[method-assign]
    return policy


def make_engine(zero_stage: int, seed: int = 0) -> Engine:
    cfg = settings(zero_stage)
    return build_engine(make_policy(seed), cfg.optimizer(), cfg.deepspeed())


def batch(seed: int, T: int = 16, N: int = 4) -> FragmentBatch:
    """A fragment with a learnable value target (reward = first feature) and a truncation."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(T, N, OBS_DIM, generator=g)
    truncated = torch.zeros(T, N, dtype=torch.bool)
    truncated[T // 2, 1] = True
    return FragmentBatch(
        [
            Fragment(
                fragment_id=f"f{seed}",
                actor_id="actor-0",
                policy_version=0,
                obs=obs,
                actions=torch.randint(0, 2, (T, N), generator=g),
                logprobs=torch.full((T, N), math.log(0.5)),
                rewards=obs[..., 0].clone(),
                terminated=torch.rand(T, N, generator=g) < 0.05,
                truncated=truncated,
                next_obs=torch.randn(N, OBS_DIM, generator=g),
                final_indices=torch.tensor([(T // 2) * N + 1]),
                final_obs=torch.randn(1, OBS_DIM, generator=g),
            )
        ]
    )


def train(engine: Engine, seeds: list[int], generator: torch.Generator) -> list[dict[str, float]]:
    return [update(engine, batch(s), settings(0), generator=generator) for s in seeds]


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_checkpoint_resumes_to_identical_losses(zero_stage: int, tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    with make_engine(zero_stage, seed=0) as first:
        train(first, [1, 2], generator)
        first.set_lr(1e-3)
        first.save(tmp_path, "update-2", {"updates": 2, "shuffle": generator.get_state()})
        expected = train(first, [3, 4], generator)
        expected_weights = first.named_weights()

    with make_engine(zero_stage, seed=99) as second:  # other initial weights, overwritten
        state = second.load(tmp_path)
        assert state is not None and state["updates"] == 2
        assert second.lr == pytest.approx(1e-3)  # optimizer state came back too
        resumed = train(second, [3, 4], torch.Generator().set_state(state["shuffle"]))
        for got, want in zip(resumed, expected, strict=True):
            assert got["losses/loss"] == pytest.approx(want["losses/loss"], rel=1e-6, abs=1e-7)
            assert got["losses/value_loss"] == pytest.approx(want["losses/value_loss"], rel=1e-6)
        for name, tensor in second.named_weights().items():
            torch.testing.assert_close(tensor, expected_weights[name], rtol=1e-6, atol=1e-7)


def test_load_without_a_checkpoint_returns_none(tmp_path: Path) -> None:
    with make_engine(0) as engine:
        assert engine.load(tmp_path / "nothing-here") is None


def test_save_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    with make_engine(0) as engine:
        for step in range(4):
            engine.save(tmp_path, f"update-{step:08d}", {"updates": step}, keep=2)
        tags = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
        assert tags == ["update-00000002", "update-00000003"]
        assert (tmp_path / "latest").read_text().strip() == "update-00000003"
        state = engine.load(tmp_path)
        assert state is not None and state["updates"] == 3


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_named_weights_equal_the_modules_state_dict(zero_stage: int) -> None:
    with make_engine(zero_stage) as engine:
        train(engine, [1], torch.Generator().manual_seed(0))
        weights = engine.named_weights()
        state = engine.module.state_dict()
        assert list(weights) == list(state)
        for name, tensor in state.items():
            assert weights[name].device.type == "cpu"
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)
        first = next(iter(state))
        before = state[first].clone()
        weights[first].add_(1.0)  # a copy: the module is untouched
        torch.testing.assert_close(engine.module.state_dict()[first], before)


def test_named_weights_are_gathered_under_zero3() -> None:
    reference = copy.deepcopy(make_policy(0).state_dict())
    with make_engine(0) as plain:
        train(plain, [1], torch.Generator().manual_seed(0))
        trained = plain.named_weights()
    with make_engine(3) as sharded:
        initial = sharded.named_weights()
        train(sharded, [1], torch.Generator().manual_seed(0))
        gathered = sharded.named_weights()
    assert list(initial) == list(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(initial[name], tensor)  # full shapes, not partitions
        torch.testing.assert_close(gathered[name], trained[name], rtol=1e-5, atol=1e-6)


def test_close_destroys_the_process_group_and_the_shm_buffer() -> None:
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    engine = make_engine(0)
    assert os.environ["WORLD_SIZE"] == "1"  # set for a plain process
    assert torch.distributed.is_initialized()
    shm = _shm_buffer_path()
    assert shm is not None
    shm.write_bytes(b"")  # stands in for the comm op's buffer (it is built for >1 local rank)
    engine.close()
    engine.close()  # idempotent
    assert not torch.distributed.is_initialized()
    assert not shm.exists()
    # The rank variables are undone: a child process must not take them for a launcher's.
    assert {k: os.environ.get(k) for k in before} == before
