"""Generalised advantage estimation over fixed-length rollout fragments.

Schulman, Moritz, Levine, Jordan, Abbeel (2016), "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", ICLR, arXiv:1506.02438, eq. (11)-(16).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.registry import GAME_ADVANTAGES


@GAME_ADVANTAGES.register("gae")
@torch.no_grad()
def gae(
    rewards: Tensor,  # [T, N]
    values: Tensor,  # [T, N]
    *,
    terminated: Tensor,  # [T, N] bool
    truncated: Tensor,  # [T, N] bool
    last_value: Tensor,  # [N]
    final_values: Tensor | None = None,  # [T, N], read only where truncated
    gamma: float = 0.99,
    lam: float = 0.95,
    bootstrap_truncated: bool = True,
) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) advantages and lambda-returns for a fragment of T steps of N envs.

    Step t of env n saw observation s_t, got reward r_t and ended (or not) the episode. The value
    of the state that follows step t is

        V_next_t = 0                   if terminated_t            (true end: no future reward)
                 = final_values_t      if truncated_t             (time limit: bootstrap from
                                                                   V(final observation))
                 = last_value          if t = T-1 and not done    (fragment end)
                 = values_{t+1}        otherwise

    (termination wins when both flags are set) and then (Schulman et al. 2016, eq. 11-16)

        delta_t = r_t + gamma * V_next_t - V(s_t)
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   A_T = 0,
        done_t  = terminated_t or truncated_t
        R_t     = A_t + V(s_t)              (lambda-return, the value target)

    so the recursion never crosses an episode boundary inside the fragment. With lam = 1 and
    values = 0, R_t is the discounted return.

    Args:
        rewards: r_t, ``[T, N]``.
        values: V(s_t) from the behaviour policy's critic, ``[T, N]``.
        terminated: the episode ended at step t by reaching a terminal state, ``[T, N]`` bool.
        truncated: the episode was cut at step t (time limit) without a terminal state, ``[T, N]``.
        last_value: V(s_T) of the observation after the last step of the fragment, ``[N]``.
            It is used only for envs whose last step is not done.
        final_values: V(final observation) for truncated steps, ``[T, N]``; entries where
            ``truncated`` is false are ignored (may hold anything, NaN included). Required when any
            step is truncated, unless ``bootstrap_truncated=False``.
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1]; 0 gives one-step TD errors, 1 gives Monte-Carlo advantages.
        bootstrap_truncated: ``False`` treats truncation as termination (no bootstrap), which is
            biased but is what many baselines do; ``final_values`` is then ignored.

    Returns:
        ``(advantages, returns)``, each ``[T, N]`` in the promoted float dtype of rewards/values,
        computed without gradient.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [T, N], got shape {tuple(rewards.shape)}")
    shape = rewards.shape
    for name, x in (("values", values), ("terminated", terminated), ("truncated", truncated)):
        if x.shape != shape:
            raise ValueError(f"{name} must match rewards {tuple(shape)}, got {tuple(x.shape)}")
    if last_value.shape != shape[1:]:
        raise ValueError(f"last_value must be{tuple(shape[1:])}, got {tuple(last_value.shape)}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")

    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    rewards, values = rewards.to(dtype), values.to(dtype)
    terminated, truncated = terminated.bool(), truncated.bool()
    done = terminated | truncated  # [T, N]

    next_values = torch.empty_like(values)  # [T, N] V_next_t
    next_values[:-1] = values[1:]
    next_values[-1] = last_value.to(dtype)
    if bootstrap_truncated:
        cut = truncated & ~terminated
        if final_values is not None:
            if final_values.shape != shape:
                raise ValueError(
                    f"final_values must match rewards {tuple(shape)}, "
                    f"got {tuple(final_values.shape)}"
                )
            next_values = torch.where(cut, final_values.to(dtype), next_values)
        elif bool(cut.any()):
            raise ValueError(
                "truncated steps need final_values (V of the final observation) to bootstrap; "
                "pass final_values or bootstrap_truncated=False"
            )
        next_values = torch.where(terminated, 0.0, next_values)
    else:
        next_values = torch.where(done, 0.0, next_values)

    deltas = rewards + gamma * next_values - values  # [T, N]
    carry = (gamma * lam) * (~done).to(dtype)  # [T, N] weight of A_{t+1} in A_t
    advantages = torch.empty_like(deltas)
    running = torch.zeros_like(deltas[0])  # [N] A_{t+1}
    for t in range(shape[0] - 1, -1, -1):
        running = deltas[t] + carry[t] * running
        advantages[t] = running
    return advantages, advantages + values


@torch.no_grad()
def discounted_returns(
    rewards: Tensor,  # [T, N]
    dones: Tensor,  # [T, N] bool
    *,
    gamma: float = 0.99,
    last_value: Tensor | None = None,  # [N]
) -> Tensor:
    """Discounted returns ``G_t = r_t + gamma * (1 - done_t) * G_{t+1}`` with ``G_T = last_value``.

    ``last_value`` (default 0) bootstraps envs whose episode continues past the fragment; a done
    step stops the sum. Returns ``[T, N]``.
    """
    if rewards.ndim != 2 or dones.shape != rewards.shape:
        raise ValueError(
            f"rewards and dones must both be [T, N], got {tuple(rewards.shape)} "
            f"and {tuple(dones.shape)}"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    keep = gamma * (~dones.bool()).to(dtype)  # [T, N]
    running = (
        torch.zeros_like(rewards[0], dtype=dtype) if last_value is None else last_value.to(dtype)
    )
    out = torch.empty_like(rewards, dtype=dtype)
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t].to(dtype) + keep[t] * running
        out[t] = running
    return out
