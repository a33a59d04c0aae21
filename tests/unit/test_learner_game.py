"""learner.game: fragment decoding, GAE through the fragment path and the update. (The consumer's
bookkeeping rules, shared with the LM workload, are in test_learner_loop.py.)"""

from __future__ import annotations

import math
from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import pytest
import torch

from common import tensor
from common.policies import PolicyConfig, build_policy
from learner.engine import Engine, NonfiniteUpdate, build_engine, check_step
from learner.game.settings import LearnerSettings
from learner.game.update import FragmentBatch, decode_fragment, prepare, update
from learner.game.workload import build_game_engine
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.common.v1 import tensor_pb2
from services.errors import InvalidArgument

OBS_DIM = 4


def _tree(array: np.ndarray) -> tensor_pb2.TensorTree:
    return tensor_pb2.TensorTree(tensor=tensor.encode(array))


def make_fragment(
    rewards: np.ndarray,  # [T, N]
    *,
    values: np.ndarray | None = None,  # [T, N]
    bootstrap_values: np.ndarray | None = None,  # [N]
    terminated: np.ndarray | None = None,
    truncated: np.ndarray | None = None,
    final_values: np.ndarray | None = None,  # [K] for the truncated, non-terminated steps
    policy_version: int = 0,
    fragment_id: str = "run/actor-0/inc/0",
    seed: int = 0,
) -> trajectory_pb2.RolloutFragment:
    """A RolloutFragment as an actor builds it, with CartPole-shaped random observations."""
    rng = np.random.default_rng(seed)
    T, N = rewards.shape
    terminated = np.zeros((T, N), bool) if terminated is None else terminated
    truncated = np.zeros((T, N), bool) if truncated is None else truncated
    cut = np.flatnonzero((truncated & ~terminated).reshape(-1)).astype(np.int64)
    msg = trajectory_pb2.RolloutFragment(
        run="run",
        actor_id="actor-0",
        fragment_id=fragment_id,
        policy_version=policy_version,
        num_steps=T,
        num_envs=N,
        observations=_tree(rng.normal(size=(T, N, OBS_DIM)).astype(np.float32)),
        actions=_tree(rng.integers(0, 2, size=(T, N)).astype(np.int64)),
        logprobs=tensor.encode(np.full((T, N), math.log(0.5), np.float32)),
        rewards=tensor.encode(rewards.astype(np.float32)),
        terminated=tensor.encode(terminated),
        truncated=tensor.encode(truncated),
        next_observations=_tree(rng.normal(size=(N, OBS_DIM)).astype(np.float32)),
    )
    if values is not None:
        msg.values.CopyFrom(tensor.encode(values.astype(np.float32)))
        msg.bootstrap_values.CopyFrom(tensor.encode(np.asarray(bootstrap_values, np.float32)))
    if cut.size:
        msg.final_indices.CopyFrom(tensor.encode(cut))
        finals = rng.normal(size=(cut.size, OBS_DIM)).astype(np.float32)
        msg.final_observations.CopyFrom(_tree(finals))
        if values is not None:
            msg.final_values.CopyFrom(tensor.encode(np.asarray(final_values, np.float32)))
    return msg


def hand_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_value: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    final_value: dict[tuple[int, int], float],
    gamma: float,
    lam: float,
) -> np.ndarray:
    """GAE written out per env and step, straight from the definition."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if terminated[t, n]:
                v_next = 0.0
            elif truncated[t, n]:
                v_next = final_value[(t, n)]
            elif t == T - 1:
                v_next = next_value[n]
            else:
                v_next = values[t + 1, n]
            done = terminated[t, n] or truncated[t, n]
            delta = rewards[t, n] + gamma * v_next - values[t, n]
            running = delta + gamma * lam * (0.0 if done else running)
            adv[t, n] = running
    return adv


def settings(**overrides: object) -> LearnerSettings:
    base: dict[str, object] = {"device": "cpu", "recompute_values": False}
    base.update(overrides)
    return LearnerSettings.model_validate(base)


# ---------------------------------------------------------------------------- decoding


def test_decode_fragment_keeps_every_array() -> None:
    rewards = np.arange(6, dtype=np.float32).reshape(3, 2)
    truncated = np.zeros((3, 2), bool)
    truncated[1, 0] = True
    msg = make_fragment(
        rewards,
        values=np.ones((3, 2)),
        bootstrap_values=np.array([2.0, 3.0]),
        truncated=truncated,
        final_values=np.array([7.0]),
        policy_version=5,
    )
    frag = decode_fragment(msg, (OBS_DIM,), ())
    assert (frag.num_steps, frag.num_envs, frag.size) == (3, 2, 6)
    assert frag.policy_version == 5
    assert torch.equal(frag.rewards, torch.from_numpy(rewards))
    assert frag.obs.shape == (3, 2, OBS_DIM) and frag.next_obs.shape == (2, OBS_DIM)
    assert frag.final_indices.tolist() == [2]  # t=1, n=0 -> 1 * 2 + 0
    assert frag.final_values is not None and frag.final_values.tolist() == [7.0]
    frag.rewards += 1  # decoded tensors are writable copies, not views of the message


def test_decode_fragment_names_the_bad_field() -> None:
    msg = make_fragment(np.zeros((3, 2)))
    msg.rewards.CopyFrom(tensor.encode(np.zeros((3, 3), np.float32)))
    with pytest.raises(InvalidArgument, match="rewards: expected shape"):
        decode_fragment(msg)
    msg = make_fragment(np.zeros((3, 2)))
    with pytest.raises(InvalidArgument, match="observations"):
        decode_fragment(msg, obs_shape=(8,))
    truncated = np.zeros((3, 2), bool)
    truncated[2, 1] = True
    msg = make_fragment(np.zeros((3, 2)), truncated=truncated)
    msg.final_indices.CopyFrom(tensor.encode(np.array([4], np.int64)))  # should be 5
    with pytest.raises(InvalidArgument, match="final_indices"):
        decode_fragment(msg)


# ---------------------------------------------------------------------------- advantages


def test_gae_through_the_fragment_path_matches_hand_computation() -> None:
    rng = np.random.default_rng(3)
    T, N = 5, 3
    rewards = rng.normal(size=(T, N))
    values = rng.normal(size=(T, N))
    bootstrap = rng.normal(size=N)
    terminated = np.zeros((T, N), bool)
    truncated = np.zeros((T, N), bool)
    terminated[1, 0] = True
    truncated[3, 1] = True
    truncated[4, 2] = True  # truncated on the last step: final value, not bootstrap value
    terminated[2, 2] = truncated[2, 2] = True  # both: termination wins, no final value
    final_values = np.array([10.0, -4.0])  # for flat indices 3*3+1=10 and 4*3+2=14
    msg = make_fragment(
        rewards,
        values=values,
        bootstrap_values=bootstrap,
        terminated=terminated,
        truncated=truncated,
        final_values=final_values,
    )
    cfg = settings(gamma=0.9, gae_lambda=0.8)
    rollout = prepare(FragmentBatch([decode_fragment(msg)]), cfg)

    finals = {(3, 1): 10.0, (4, 2): -4.0}
    expected = hand_gae(rewards, values, bootstrap, terminated, truncated, finals, 0.9, 0.8)
    got = rollout.advantages.numpy().reshape(T, N)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        rollout.returns.numpy().reshape(T, N), expected + values, rtol=1e-5, atol=1e-5
    )


def test_truncation_bootstraps_from_final_values_only_where_truncated() -> None:
    T, N = 4, 2
    truncated = np.zeros((T, N), bool)
    truncated[1, 1] = True

    def advantages(final_value: float, bootstrap_truncated: bool = True) -> np.ndarray:
        msg = make_fragment(
            np.ones((T, N)),
            values=np.zeros((T, N)),
            bootstrap_values=np.zeros(N),
            truncated=truncated,
            final_values=np.array([final_value]),
        )
        cfg = settings(gamma=0.5, gae_lambda=1.0, bootstrap_truncated=bootstrap_truncated)
        return prepare(FragmentBatch([decode_fragment(msg)]), cfg).advantages.numpy()

    low, high = advantages(0.0).reshape(T, N), advantages(8.0).reshape(T, N)
    diff = high - low
    # Only env 1 at and before the cut sees V(final obs): 0.5 * 8 at t=1, halved again at t=0.
    np.testing.assert_allclose(diff[:, 0], 0.0)
    np.testing.assert_allclose(diff[:, 1], [2.0, 4.0, 0.0, 0.0])
    # Treated as a termination, the final value does not matter.
    np.testing.assert_allclose(advantages(0.0, False), advantages(8.0, False))


def test_batch_stacks_fragments_like_separate_ones() -> None:
    rng = np.random.default_rng(7)

    def frag(T: int, N: int, seed: int) -> trajectory_pb2.RolloutFragment:
        terminated = rng.random((T, N)) < 0.2
        truncated = (rng.random((T, N)) < 0.2) & ~terminated
        return make_fragment(
            rng.normal(size=(T, N)),
            values=rng.normal(size=(T, N)),
            bootstrap_values=rng.normal(size=N),
            terminated=terminated,
            truncated=truncated,
            final_values=rng.normal(size=int(truncated.sum())),
            fragment_id=f"f{seed}",
            seed=seed,
        )

    fragments = [decode_fragment(f) for f in (frag(6, 2, 0), frag(4, 3, 1), frag(6, 1, 2))]
    cfg = settings()
    together = prepare(FragmentBatch(fragments), cfg)
    assert len(FragmentBatch(fragments).segments()) == 2  # T=6 (two fragments) and T=4
    assert together.size == 6 * 2 + 4 * 3 + 6 * 1
    alone = {f.fragment_id: prepare(FragmentBatch([f]), cfg).advantages for f in fragments}
    # Segment T=6 holds f0's columns then f2's, in row-major [T, N] order; T=4 is f1.
    seg6 = together.advantages[:18].reshape(6, 3)
    np.testing.assert_allclose(seg6[:, :2].reshape(-1), alone["f0"], rtol=1e-6)
    np.testing.assert_allclose(seg6[:, 2:].reshape(-1), alone["f2"], rtol=1e-6)
    np.testing.assert_allclose(together.advantages[18:], alone["f1"], rtol=1e-6)


def test_recompute_values_uses_the_learners_critic() -> None:
    msg = make_fragment(
        np.zeros((3, 2)), values=np.full((3, 2), 100.0), bootstrap_values=np.full(2, 100.0)
    )
    batch = FragmentBatch([decode_fragment(msg)])

    def critic(obs: torch.Tensor) -> torch.Tensor:
        return torch.full((obs.shape[0],), 1.0)

    actor_values = prepare(batch, settings(recompute_values=False), critic)
    learner_values = prepare(batch, settings(recompute_values=True), critic)
    assert torch.all(actor_values.values == 100.0)
    assert torch.all(learner_values.values == 1.0)
    # gamma * V(next) - V(s) with V = 1 everywhere and lambda = 0.95
    assert learner_values.advantages[-1].item() == pytest.approx(0.99 - 1.0)


def test_fragments_without_values_need_a_critic() -> None:
    batch = FragmentBatch([decode_fragment(make_fragment(np.zeros((2, 2))))])
    with pytest.raises(InvalidArgument, match="no values"):
        prepare(batch, settings(recompute_values=False))
    rollout = prepare(batch, settings(recompute_values=False), lambda o: torch.zeros(len(o)))
    assert rollout.size == 4


# ---------------------------------------------------------------------------- update


@pytest.fixture
def engine() -> Iterator[Engine]:
    torch.manual_seed(0)
    space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    policy = build_policy(space, gym.spaces.Discrete(2), PolicyConfig(hidden_sizes=(16, 16)))
    policy.forward = policy.evaluate  # type: ignore[method-assign]
    cfg = settings(learning_rate=1e-2, minibatch_size=32)
    with build_engine(policy, cfg.optimizer(), cfg.deepspeed()) as built:
        yield built


def synthetic_batch(engine: Engine, n: int = 2) -> FragmentBatch:
    """Fragments whose behaviour log-probabilities are the engine policy's own and whose reward
    is the first observation feature (with gamma = 0 the value target is learnable)."""
    rng = np.random.default_rng(11)
    fragments = []
    for i in range(n):
        terminated = rng.random((16, 4)) < 0.1
        msg = make_fragment(
            rng.normal(size=(16, 4)),
            values=np.zeros((16, 4)),
            bootstrap_values=np.zeros(4),
            terminated=terminated,
            fragment_id=f"f{i}",
            seed=i,
        )
        frag = decode_fragment(msg)
        with torch.no_grad():
            _, logp, _, _ = engine.module.evaluate(  # type: ignore[operator]
                frag.obs.reshape(-1, OBS_DIM), frag.actions.reshape(-1)
            )
        frag.logprobs = logp.reshape(16, 4)
        frag.rewards = frag.obs[..., 0].clone()
        fragments.append(frag)
    return FragmentBatch(fragments)


@pytest.mark.slow  # a DeepSpeed engine (JIT-builds its comm op on a fresh machine)
def test_update_reduces_the_loss(engine: Engine) -> None:
    batch = synthetic_batch(engine)
    cfg = settings(
        learning_rate=1e-2,
        minibatch_size=32,
        update_epochs=2,
        clip_vloss=False,
        gamma=0.0,
        recompute_values=True,  # explained variance then measures the critic being trained
    )
    first = update(engine, batch, cfg, generator=torch.Generator().manual_seed(0))
    for _ in range(8):
        last = update(engine, batch, cfg, generator=torch.Generator().manual_seed(0))
    assert last["losses/value_loss"] < 0.5 * first["losses/value_loss"]
    assert last["losses/explained_variance"] > first["losses/explained_variance"]
    for key in (
        "losses/policy_loss",
        "losses/value_loss",
        "losses/entropy",
        "losses/approx_kl",
        "losses/clipfrac",
        "losses/explained_variance",
        "charts/learning_rate",
    ):
        assert math.isfinite(last[key]), key
    assert first["losses/epochs"] == 2


@pytest.mark.slow  # a DeepSpeed engine (JIT-builds its comm op on a fresh machine)
def test_update_sets_the_learning_rate_and_runs_a2c(engine: Engine) -> None:
    batch = synthetic_batch(engine, n=1)
    metrics = update(engine, batch, settings(algo="a2c", minibatch_size=64), lr=1e-3)
    assert metrics["charts/learning_rate"] == pytest.approx(1e-3)
    assert engine.lr == pytest.approx(1e-3)
    assert "losses/clipfrac" not in metrics  # a PPO-only metric
    assert math.isfinite(metrics["losses/policy_loss"])


@pytest.mark.slow  # a DeepSpeed engine (JIT-builds its comm op on a fresh machine)
def test_target_kl_stops_the_epochs_early(engine: Engine) -> None:
    batch = synthetic_batch(engine)
    cfg = settings(learning_rate=5e-2, update_epochs=4, minibatch_size=32, target_kl=1e-9)
    assert update(engine, batch, cfg)["losses/epochs"] == 1


@pytest.mark.slow  # two DeepSpeed engines
def test_direct_calls_train_the_same_bits_as_deepspeeds() -> None:
    """The learner's engine (one fp32 rank, learner.game clipping) makes the module, backward
    and optimizer calls itself; trained side by side with the same engine making DeepSpeed's
    calls, the weights and the step counters its checkpoints record come out identical."""
    cfg = settings(learning_rate=1e-2, minibatch_size=32, update_epochs=2, max_grad_norm=0.05)
    space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    engines = []
    for direct in (True, False):
        torch.manual_seed(0)
        policy = build_policy(space, gym.spaces.Discrete(2), PolicyConfig(hidden_sizes=(16, 16)))
        policy.forward = policy.evaluate  # type: ignore[method-assign]
        built = build_game_engine(policy, cfg)
        assert built.direct  # what the learner runs
        built.direct = direct
        engines.append(built)
    try:
        batch = synthetic_batch(engines[0])
        for engine in engines:
            for _ in range(3):
                update(engine, batch, cfg, generator=torch.Generator().manual_seed(0),
                       clip_grad=True)  # fmt: skip
        direct, deepspeed = (e.named_weights() for e in engines)
        for name, weight in deepspeed.items():
            assert torch.equal(direct[name], weight), name
        steps = [(e.ds.global_steps, e.ds.global_samples) for e in engines]
        assert steps[0] == steps[1] and steps[0][0] == 3 * 2 * 4  # updates x epochs x minibatches
    finally:
        for engine in engines:
            engine.close()


def test_an_engine_with_deepspeed_clipping_keeps_deepspeeds_calls(engine: Engine) -> None:
    assert engine.settings.gradient_clipping  # max_grad_norm's default, clipped by DeepSpeed
    assert not engine.direct


# ---------------------------------------------------------------------------- non-finite data


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.slow  # a DeepSpeed engine (JIT-builds its comm op on a fresh machine)
@pytest.mark.parametrize("direct", [False, True], ids=["deepspeed-clipping", "direct"])
def test_a_nan_fragment_stops_the_update_before_any_step(engine: Engine, direct: bool) -> None:
    cfg = settings(learning_rate=1e-2, minibatch_size=32, update_epochs=2)
    if direct:  # the engine a single fp32 rank gets (build_game_engine): no DeepSpeed step
        space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
        policy = build_policy(space, gym.spaces.Discrete(2), PolicyConfig(hidden_sizes=(16, 16)))
        policy.forward = policy.evaluate  # type: ignore[method-assign]
        engine.close()
        engine = build_game_engine(policy, cfg)
        assert engine.direct
    batch = synthetic_batch(engine)
    batch.fragments[1].obs[3, 2, 1] = math.nan
    before, steps = _weights(engine), engine.ds.global_steps
    with pytest.raises(NonfiniteUpdate, match="NaN/inf in the batch's observations") as err:
        update(engine, batch, cfg, clip_grad=direct, generator=torch.Generator().manual_seed(0))
    assert err.value.sources == ["actor-0 (fragment f1): NaN/inf in observations"]
    after = _weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)  # not one step applied
    assert engine.ds.global_steps == steps
    # The next, clean batch trains as usual.
    metrics = update(engine, synthetic_batch(engine), cfg, clip_grad=direct)
    assert math.isfinite(metrics["losses/loss"])
    assert all(torch.isfinite(v).all() for v in _weights(engine).values())
    engine.close()


@pytest.mark.slow  # a DeepSpeed engine (JIT-builds its comm op on a fresh machine)
def test_a_nan_loss_or_gradient_is_never_stepped(engine: Engine) -> None:
    """Finite data, a diverged step: check_step drops its gradients before the optimizer."""
    batch = synthetic_batch(engine)
    obs = batch.fragments[0].obs.reshape(-1, OBS_DIM)
    before, steps = _weights(engine), engine.ds.global_steps
    _, logp, _, value = engine(obs, batch.fragments[0].actions.reshape(-1))
    loss = (logp.mean() + value.mean()) * math.inf  # an overflow: the gradients are inf/NaN
    engine.backward(loss)
    with pytest.raises(NonfiniteUpdate, match=r"loss (-?inf|nan)"):
        check_step(engine, loss)
    assert all(p.grad is None for p in engine.module.parameters())
    assert engine.ds.global_steps == steps
    assert all(torch.equal(before[k], v) for k, v in _weights(engine).items())
