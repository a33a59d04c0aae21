"""The learner's update is bench/game/ppo_baseline.py's update: the same batch, the same initial
weights and the same minibatch order give the same weights after one update, through the
DeepSpeed engine and the RolloutFragment path, so the system and the baseline are comparable."""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from bench.game.ppo_baseline import Agent, PPOArgs
from common import tensor
from common.policies import PolicyConfig, build_policy
from learner.algos import aggregate, entropy_loss, gae, normalize_advantages, ppo_clip, value_loss
from learner.engine import build_engine
from learner.game.settings import LearnerSettings
from learner.game.update import FragmentBatch, decode_fragment, update
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.common.v1 import tensor_pb2

pytestmark = pytest.mark.slow  # DeepSpeed training runs: not in `make test-fast`

T, N = 32, 8


def _tree(array: np.ndarray) -> tensor_pb2.TensorTree:
    return tensor_pb2.TensorTree(tensor=tensor.encode(array))


def rollout(
    agent: Agent, seed: int
) -> tuple[dict[str, torch.Tensor], trajectory_pb2.RolloutFragment]:
    """T steps of N CartPole envs with a 20-step time limit (so truncations happen), as the
    baseline stores them and as an actor publishes them."""
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=20) for _ in range(N)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    obs = torch.zeros(T + 1, N, 4)
    b = {k: torch.zeros(T, N) for k in ("logprobs", "values", "rewards", "final_values")}
    actions = torch.zeros(T, N, dtype=torch.long)
    terminated = torch.zeros(T, N, dtype=torch.bool)
    truncated = torch.zeros(T, N, dtype=torch.bool)
    final_index, final_obs = [], []
    first, _ = envs.reset(seed=seed)
    obs[0] = torch.as_tensor(first)
    torch.manual_seed(seed)
    for t in range(T):
        with torch.no_grad():
            action, logp, _, value = agent.get_action_and_value(obs[t])
        actions[t], b["logprobs"][t], b["values"][t] = action, logp, value
        nxt, reward, term, trunc, info = envs.step(action.numpy())
        obs[t + 1] = torch.as_tensor(nxt)
        b["rewards"][t] = torch.as_tensor(reward, dtype=torch.float32)
        terminated[t], truncated[t] = torch.as_tensor(term), torch.as_tensor(trunc)
        for n in np.flatnonzero(trunc & ~term):
            final = torch.as_tensor(info["final_obs"][n], dtype=torch.float32)
            with torch.no_grad():
                b["final_values"][t, n] = agent.get_value(final[None])[0]
            final_index.append(t * N + n)
            final_obs.append(final.numpy())
    envs.close()
    assert final_index, "the time limit should truncate some episodes"
    with torch.no_grad():
        last_value = agent.get_value(obs[T])
    b.update(obs=obs[:T], actions=actions, terminated=terminated, truncated=truncated)
    b["last_value"] = last_value
    cut = torch.tensor(final_index)
    msg = trajectory_pb2.RolloutFragment(
        fragment_id="baseline/0",
        num_steps=T,
        num_envs=N,
        observations=_tree(obs[:T].numpy()),
        actions=_tree(actions.numpy()),
        logprobs=tensor.encode(b["logprobs"]),
        values=tensor.encode(b["values"]),
        rewards=tensor.encode(b["rewards"]),
        terminated=tensor.encode(terminated.numpy()),
        truncated=tensor.encode(truncated.numpy()),
        next_observations=_tree(obs[T].numpy()),
        bootstrap_values=tensor.encode(last_value),
        final_indices=tensor.encode(cut.numpy().astype(np.int64)),
        final_observations=_tree(np.stack(final_obs)),
        final_values=tensor.encode(b["final_values"].reshape(-1)[cut]),
    )
    return b, msg


def baseline_update(agent: Agent, b: dict[str, torch.Tensor], args: PPOArgs, seed: int) -> None:
    """bench/game/ppo_baseline.py's "advantages" and "optimise" sections, verbatim in substance."""
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    advantages, returns = gae(
        b["rewards"],
        b["values"],
        terminated=b["terminated"],
        truncated=b["truncated"],
        last_value=b["last_value"],
        final_values=b["final_values"],
        gamma=args.gamma,
        lam=args.gae_lambda,
    )
    b_obs, b_actions, b_logprobs = (
        b["obs"].reshape(-1, 4),
        b["actions"].reshape(-1),
        b["logprobs"].reshape(-1),
    )
    b_adv, b_returns, b_values = (
        advantages.reshape(-1),
        returns.reshape(-1),
        b["values"].reshape(-1),
    )
    torch.manual_seed(seed)
    for _epoch in range(args.update_epochs):
        perm = torch.randperm(args.batch_size)
        for lo in range(0, args.batch_size, args.minibatch_size):
            mb = perm[lo : lo + args.minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
            mb_adv = normalize_advantages(b_adv[mb]) if args.norm_adv else b_adv[mb]
            pg, _ = ppo_clip(newlogprob, b_logprobs[mb], mb_adv, clip_low=args.clip_coef)
            clip = args.clip_coef if args.clip_vloss else None
            v, _ = value_loss(newvalue, b_values[mb], b_returns[mb], clip=clip)
            ent, _ = entropy_loss(entropy)
            loss = aggregate(pg) + args.vf_coef * aggregate(v) + args.ent_coef * aggregate(ent)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()


CLEANRL = {"num_minibatches": 4, "update_epochs": 2, "clip_vloss": True, "ent_coef": 0.01}


@pytest.mark.parametrize("recompute_values", [True, False])
@pytest.mark.parametrize("overrides", [{}, CLEANRL], ids=["baseline-defaults", "cleanrl"])
def test_update_matches_the_baseline(overrides: dict[str, object], recompute_values: bool) -> None:
    args = dataclasses.replace(PPOArgs(num_envs=N, rollout_length=T), **overrides)  # type: ignore[arg-type]
    torch.manual_seed(7)
    agent = Agent(4, 2, args.hidden_size)
    b, msg = rollout(agent, seed=3)

    env = gym.make("CartPole-v1")
    config = PolicyConfig(hidden_sizes=(64, 64))
    policy = build_policy(env.observation_space, env.action_space, config)
    policy.load_state_dict(agent.state_dict())
    policy.forward = policy.evaluate  # type: ignore[method-assign]
    cfg = LearnerSettings(
        device="cpu",
        learning_rate=args.learning_rate,
        gamma=args.gamma,
        gae_lambda=args.gae_lambda,
        update_epochs=args.update_epochs,
        minibatch_size=args.minibatch_size,
        clip_coef=args.clip_coef,
        clip_vloss=args.clip_vloss,
        ent_coef=args.ent_coef,
        vf_coef=args.vf_coef,
        max_grad_norm=args.max_grad_norm,
        norm_adv=args.norm_adv,
        recompute_values=recompute_values,  # on-policy: the critic gives the actor's values
    )
    baseline_update(agent, b, args, seed=11)
    with build_engine(policy, cfg.optimizer(), cfg.deepspeed()) as engine:
        batch = FragmentBatch([decode_fragment(msg, (4,), ())])
        metrics = update(engine, batch, cfg, generator=torch.Generator().manual_seed(11))
        weights = engine.named_weights()
    assert metrics["losses/epochs"] == args.update_epochs
    for name, want in agent.state_dict().items():
        torch.testing.assert_close(weights[name], want, rtol=1e-4, atol=1e-5, msg=name)
