"""Single-process PPO on CartPole-v1, CleanRL style: the reference the distributed system is
measured against.

It reads top to bottom like CleanRL's ``ppo.py`` (Huang et al. 2022, "The 37 Implementation Details
of Proximal Policy Optimization"), with CleanRL's network and tricks and tuned rollout settings (see
``PPOArgs``; ``--preset cleanrl`` restores CleanRL's defaults). All of the math (GAE, clipped
surrogate, value loss, entropy bonus, advantage normalisation, learning-rate schedule, loss
aggregation) comes from ``learner.algos``, so the baseline and the system share one implementation.
Unlike CleanRL it bootstraps time-limit truncations from the value of the final observation
(gymnasium ``AutoresetMode.SAME_STEP`` puts it in ``info["final_obs"]``).

    python -m bench.game.ppo_baseline --seed 1
    python -m bench.game.ppo_baseline --seeds 1 2 3 --out bench/results/ppo_baseline.json

From Python: ``run_baseline(PPOArgs(seed=1)) -> dict(steps, wall_s, sps, reached_target_at_step,
final_mean_return, ...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from bench._shared.results import results_json
from learner.algos import (
    aggregate,
    entropy_loss,
    gae,
    linear_anneal,
    normalize_advantages,
    ppo_clip,
    value_loss,
)

# CleanRL ppo.py's CartPole defaults, for reference (`--preset cleanrl`): they reach a mean return
# of 475 too, in more env steps than the defaults of PPOArgs below (bench/README.md).
CLEANRL_DEFAULTS: dict[str, Any] = {
    "num_envs": 4,
    "rollout_length": 128,
    "learning_rate": 2.5e-4,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "num_minibatches": 4,
    "update_epochs": 4,
    "clip_vloss": True,
    "ent_coef": 0.01,
}


@dataclass
class PPOArgs:
    """Hyperparameters. The defaults keep CleanRL's network, Adam (eps 1e-5), policy clip 0.2,
    grad-norm 0.5 and linear lr annealing, and take rl-baselines3-zoo's CartPole rollout settings
    (8 envs x 32 steps, one 256-sample minibatch, 20 epochs, gamma 0.98, lambda 0.8, no entropy
    bonus) with lr 2e-3 and no value clipping: the fastest in env steps to a mean return of 475
    of the settings tried (bench/README.md has the tuning record).
    """

    env_id: str = "CartPole-v1"
    seed: int = 1
    num_envs: int = 8  # parallel envs in one SyncVectorEnv (CleanRL: 4)
    rollout_length: int = 32  # steps per env per update (CleanRL num_steps: 128)
    total_timesteps: int = 500_000  # env-step budget; the lr anneals over it
    learning_rate: float = 2e-3  # CleanRL: 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.98  # CleanRL: 0.99
    gae_lambda: float = 0.8  # CleanRL: 0.95
    num_minibatches: int = 1  # CleanRL: 4
    update_epochs: int = 20  # CleanRL: 4
    norm_adv: bool = True  # per-minibatch advantage normalisation
    clip_coef: float = 0.2
    clip_vloss: bool = False  # CleanRL: True
    ent_coef: float = 0.0  # CleanRL: 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None  # stop the epochs of an update early above this approx_kl
    hidden_size: int = 64
    target_return: float = 475.0  # stop once the mean return of the last episodes reaches it
    return_window: int = 20  # episodes in that mean
    max_wall_s: float | None = None  # also stop after this many seconds (at an update boundary)
    torch_threads: int = 1
    verbose: bool = True  # print one line per update

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.rollout_length

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """Separate actor and critic MLPs, two tanh layers each, orthogonal init (CleanRL)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, num_actions), std=0.01),
        )

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)  # [B]

    def get_action_and_value(
        self, obs: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = Categorical(logits=self.actor(obs))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.get_value(obs)  # each [B]


def run_baseline(args: PPOArgs) -> dict[str, Any]:
    """Train PPO until the mean return of the last ``return_window`` episodes reaches
    ``target_return`` or ``total_timesteps`` env steps are spent. Returns the summary dict."""
    if args.batch_size % args.num_minibatches:
        raise ValueError("num_envs * rollout_length must be divisible by num_minibatches")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)

    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(args.env_id) for _ in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "discrete actions only"
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(obs_dim, int(envs.single_action_space.n), args.hidden_size)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    T, N = args.rollout_length, args.num_envs
    obs = torch.zeros((T, N, obs_dim))
    actions = torch.zeros((T, N), dtype=torch.long)
    logprobs = torch.zeros((T, N))
    rewards = torch.zeros((T, N))
    terminateds = torch.zeros((T, N), dtype=torch.bool)
    truncateds = torch.zeros((T, N), dtype=torch.bool)
    values = torch.zeros((T, N))
    final_values = torch.zeros((T, N))  # V(final observation), read where truncated

    start = time.perf_counter()
    global_step = 0
    reached_at: int | None = None
    reached_wall_s: float | None = None
    episode_returns: deque[float] = deque(maxlen=args.return_window)
    running_return = np.zeros(N)
    episodes = 0
    next_obs_np, _ = envs.reset(seed=args.seed)
    envs.action_space.seed(args.seed)
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32)

    stopped_by_time = False
    for update in range(1, args.num_updates + 1):
        if args.max_wall_s is not None and time.perf_counter() - start > args.max_wall_s:
            stopped_by_time = True
            break
        lr = args.learning_rate
        if args.anneal_lr:
            lr = linear_anneal(update - 1, args.num_updates, args.learning_rate)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # --- rollout: T steps of N envs --------------------------------------------------------
        for step in range(T):
            global_step += N
            obs[step] = next_obs
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            actions[step], logprobs[step], values[step] = action, logprob, value

            next_obs_np, reward, terminated, truncated, info = envs.step(action.numpy())
            rewards[step] = torch.as_tensor(reward, dtype=torch.float32)
            terminateds[step] = torch.as_tensor(terminated)
            truncateds[step] = torch.as_tensor(truncated)
            next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32)  # reset obs where done
            cut = np.flatnonzero(truncated & ~terminated)
            if cut.size:  # bootstrap time limits from the observation the episode ended on
                final_obs = torch.as_tensor(np.stack(info["final_obs"][cut]), dtype=torch.float32)
                with torch.no_grad():
                    final_values[step, cut] = agent.get_value(final_obs)

            running_return += reward
            for i in np.flatnonzero(terminated | truncated):
                episode_returns.append(float(running_return[i]))
                running_return[i] = 0.0
                episodes += 1
            if (
                reached_at is None
                and len(episode_returns) == args.return_window
                and np.mean(episode_returns) >= args.target_return
            ):
                reached_at, reached_wall_s = global_step, time.perf_counter() - start
                break
        if reached_at is not None:
            break

        # --- advantages: GAE over the fragment --------------------------------------------------
        with torch.no_grad():
            last_value = agent.get_value(next_obs)  # [N]
        advantages, returns = gae(
            rewards,
            values,
            terminated=terminateds,
            truncated=truncateds,
            last_value=last_value,
            final_values=final_values,
            gamma=args.gamma,
            lam=args.gae_lambda,
        )

        # --- optimise: epochs of shuffled minibatches -------------------------------------------
        b_obs = obs.reshape(-1, obs_dim)
        b_actions, b_logprobs = actions.reshape(-1), logprobs.reshape(-1)
        b_advantages, b_returns, b_values = (
            advantages.reshape(-1),
            returns.reshape(-1),
            values.reshape(-1),
        )
        stats: dict[str, list[float]] = {}
        for _epoch in range(args.update_epochs):
            perm = torch.randperm(args.batch_size)
            for lo in range(0, args.batch_size, args.minibatch_size):
                mb = perm[lo : lo + args.minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                    b_obs[mb], b_actions[mb]
                )
                mb_adv = b_advantages[mb]
                if args.norm_adv:
                    mb_adv = normalize_advantages(mb_adv)

                pg_per_sample, pg_metrics = ppo_clip(
                    newlogprob, b_logprobs[mb], mb_adv, clip_low=args.clip_coef
                )
                v_per_sample, _ = value_loss(
                    newvalue,
                    b_values[mb],
                    b_returns[mb],
                    clip=args.clip_coef if args.clip_vloss else None,
                )
                ent_per_sample, ent_metrics = entropy_loss(entropy)
                pg_loss, v_loss = aggregate(pg_per_sample), aggregate(v_per_sample)
                ent_loss = aggregate(ent_per_sample)  # -mean entropy
                loss = pg_loss + args.vf_coef * v_loss + args.ent_coef * ent_loss

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

                for key, val in {
                    "policy_loss": pg_loss,
                    "value_loss": v_loss,
                    **pg_metrics,
                    **ent_metrics,
                }.items():
                    stats.setdefault(key, []).append(float(val.detach()))
            if args.target_kl is not None and stats["approx_kl"][-1] > args.target_kl:
                break

        if args.verbose:
            var_y = b_returns.var()
            explained_var = float("nan") if var_y == 0 else 1 - (b_returns - b_values).var() / var_y
            sps = int(global_step / (time.perf_counter() - start))
            mean_return = np.mean(episode_returns) if episode_returns else float("nan")
            print(
                f"global_step={global_step} SPS={sps} "
                f"charts/episodic_return={mean_return:.1f} charts/learning_rate={lr:.2e} "
                f"losses/value_loss={np.mean(stats['value_loss']):.4f} "
                f"losses/policy_loss={np.mean(stats['policy_loss']):.4f} "
                f"losses/entropy={np.mean(stats['entropy']):.4f} "
                f"losses/approx_kl={np.mean(stats['approx_kl']):.2e} "
                f"losses/clipfrac={np.mean(stats['clipfrac']):.4f} "
                f"losses/explained_variance={float(explained_var):.4f}",
                flush=True,
            )

    wall_s = time.perf_counter() - start
    envs.close()
    return {
        "env_id": args.env_id,
        "seed": args.seed,
        "steps": global_step,
        "wall_s": round(wall_s, 3),
        "sps": round(global_step / wall_s, 1),
        "reached_target_at_step": reached_at,
        "reached_target_wall_s": None if reached_wall_s is None else round(reached_wall_s, 3),
        "final_mean_return": float(np.mean(episode_returns)) if episode_returns else None,
        "episodes": episodes,
        "stopped_by_time": stopped_by_time,
        "args": dataclasses.asdict(args),
    }


def parse_args(argv: list[str] | None = None) -> tuple[PPOArgs, list[int], Path | None]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=["tuned", "cleanrl"], default="tuned")
    known, _ = pre.parse_known_args(argv)
    base = PPOArgs(**(CLEANRL_DEFAULTS if known.preset == "cleanrl" else {}))

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[pre])
    for field in dataclasses.fields(PPOArgs):
        flags = [f"--{field.name.replace('_', '-')}"]
        if "_" in field.name:
            flags.append(f"--{field.name}")
        default = getattr(base, field.name)
        if isinstance(default, bool):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default)
        elif field.name in ("target_kl", "max_wall_s"):
            parser.add_argument(*flags, type=float, default=default)
        else:
            parser.add_argument(*flags, type=type(default), default=default)
    parser.add_argument("--seeds", type=int, nargs="+", help="run these seeds one after another")
    parser.add_argument("--out", type=Path, help="write the results (a JSON list) here")
    ns = vars(parser.parse_args(argv))
    seeds, out = ns.pop("seeds"), ns.pop("out")
    ns.pop("preset")
    args = PPOArgs(**ns)
    return args, seeds or [args.seed], out


def main(argv: list[str] | None = None) -> None:
    args, seeds, out = parse_args(argv)
    results = [run_baseline(dataclasses.replace(args, seed=seed)) for seed in seeds]
    print(f"\n{'seed':>4} {'steps to target':>15} {'wall s to target':>16} {'SPS':>7} {'final':>7}")
    for r in results:
        reached = r["reached_target_at_step"]
        print(
            f"{r['seed']:>4} {reached if reached is not None else 'not reached':>15} "
            f"{r['reached_target_wall_s'] if reached is not None else '-':>16} "
            f"{r['sps']:>7.0f} {r['final_mean_return'] or 0:>7.1f}"
        )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(results_json(results))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
