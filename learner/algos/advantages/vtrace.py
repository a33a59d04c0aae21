"""V-trace off-policy targets over fixed-length rollout fragments.

Espeholt, Soyer, Munos, Simonyan, Mnih, Ward, Doron, Firoiu, Harley, Dunning, Legg, Kavukcuoglu
(2018), "IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner
Architectures", ICML, arXiv:1802.01561, section 4.1, eq. (1) and the recursion below it; the
lambda in the traces as in the paper's remark 4 (RLlib's APPO ``lambda_``).

``vtrace`` is the pure function; ``vtrace_advantages`` adapts it to ``GameAdvantageFn`` (the
``vtrace`` entry of ``GAME_ADVANTAGES``, the advantage of the ``appo`` game preset).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from learner.algos.registry import GAME_ADVANTAGES


class VTrace(NamedTuple):
    vs: Tensor  # [T, N] V-trace value targets v_s
    pg_advantages: Tensor  # [T, N] rho_s (r_s + gamma_s v_{s+1} - V(x_s))
    rhos: Tensor  # [T, N] unclipped importance ratios pi / mu


@torch.no_grad()
def vtrace(
    behaviour_logp: Tensor,  # [T, N] log mu(a_t|x_t), the actor's policy
    target_logp: Tensor,  # [T, N] log pi(a_t|x_t), the learner's policy
    rewards: Tensor,  # [T, N] r_t
    values: Tensor,  # [T, N] V(x_t), the learner's critic
    bootstrap_value: Tensor,  # [N] V(x_T) after the last step
    discounts: Tensor,  # [T, N] gamma_t = gamma * (1 - terminated_t)
    *,
    truncated: Tensor | None = None,  # [T, N] bool: episode cut at t (time limit)
    final_values: Tensor | None = None,  # [T, N] V(final observation), read where truncated
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    pg_rho_bar: float | None = None,
    lam: float = 1.0,
) -> VTrace:
    """V-trace targets and policy-gradient advantages (IMPALA eq. 1).

    With rho_t = min(rho_bar, pi/mu), c_t = lam * min(c_bar, pi/mu) and the TD error
    delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)), the targets follow the paper's recursion

        v_t - V(x_t) = delta_t + gamma_t c_t (v_{t+1} - V(x_{t+1})),   v_T = V(x_T) (bootstrap)

    and the policy-gradient advantage is pg_rho_t (r_t + gamma_t v_{t+1} - V(x_t)), with
    pg_rho_t = min(pg_rho_bar, pi/mu) (pg_rho_bar defaults to rho_bar).

    Episode ends: ``discounts`` is 0 after a termination, so nothing flows back across it. A
    truncated step (``truncated``, not terminated) bootstraps from ``final_values`` instead of
    the next row (which belongs to the next episode) and cuts the trace there: V(x_{t+1}) and
    v_{t+1} are both V(final observation).

    On-policy (pi = mu, rho_bar and c_bar >= 1) v_t is the lambda-return of GAE and, at lam = 1,
    the n-step bootstrapped return and pg advantage of GAE(lambda=1).

    Returns ``VTrace(vs, pg_advantages, rhos)``, each ``[T, N]`` float (at least float32), without
    gradient.
    """
    shape = rewards.shape
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [T, N], got shape {tuple(shape)}")
    named = {
        "behaviour_logp": behaviour_logp,
        "target_logp": target_logp,
        "values": values,
        "discounts": discounts,
    }
    if truncated is not None:
        named["truncated"] = truncated
    for name, x in named.items():
        if x.shape != shape:
            raise ValueError(f"{name} must match rewards {tuple(shape)}, got {tuple(x.shape)}")
    if bootstrap_value.shape != shape[1:]:
        raise ValueError(
            f"bootstrap_value must be {tuple(shape[1:])}, got {tuple(bootstrap_value.shape)}"
        )
    if rho_bar <= 0 or c_bar <= 0 or (pg_rho_bar is not None and pg_rho_bar <= 0):
        raise ValueError(f"clip thresholds must be > 0, got rho_bar={rho_bar}, c_bar={c_bar}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must lie in [0, 1], got {lam}")

    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    rewards, values, discounts = rewards.to(dtype), values.to(dtype), discounts.to(dtype)
    rhos = torch.exp(target_logp.to(dtype) - behaviour_logp.to(dtype))  # [T, N]
    clipped_rhos = rhos.clamp(max=rho_bar)  # [T, N]
    cs = lam * rhos.clamp(max=c_bar)  # [T, N]
    pg_rhos = rhos.clamp(max=rho_bar if pg_rho_bar is None else pg_rho_bar)  # [T, N]

    next_values = torch.empty_like(values)  # [T, N] V(x_{t+1})
    next_values[:-1] = values[1:]
    next_values[-1] = bootstrap_value.to(dtype)
    carry = discounts * cs  # [T, N] weight of v_{t+1} - V(x_{t+1}) in v_t - V(x_t)
    if truncated is not None:
        cut = truncated.bool() & (discounts != 0)  # terminated wins: gamma_t = 0 already
        if bool(cut.any()):
            if final_values is None or final_values.shape != shape:
                raise ValueError(
                    "truncated steps need final_values [T, N] (V of the final observation)"
                )
            next_values = torch.where(cut, final_values.to(dtype), next_values)
            carry = torch.where(cut, 0.0, carry)

    deltas = clipped_rhos * (rewards + discounts * next_values - values)  # [T, N]
    corrections = torch.empty_like(deltas)  # [T, N] v_t - V(x_t)
    running = torch.zeros_like(deltas[0])  # [N] v_{t+1} - V(x_{t+1}), 0 at t + 1 = T
    for t in range(shape[0] - 1, -1, -1):
        running = deltas[t] + carry[t] * running
        corrections[t] = running
    vs = corrections + values  # [T, N]

    # v_{t+1} of the pg target: V-trace's own in the same episode; v_T = V(x_T) at the fragment
    # end; V(final observation) after a truncation (the next row is another episode).
    next_vs = next_values.clone()  # [T, N]
    same_episode = carry.new_ones(shape, dtype=torch.bool)  # [T, N]
    if truncated is not None:
        same_episode = ~truncated.bool()
    next_vs[:-1] = torch.where(same_episode[:-1], vs[1:], next_values[:-1])
    pg_advantages = pg_rhos * (rewards + discounts * next_vs - values)  # [T, N]
    return VTrace(vs, pg_advantages, rhos)


@GAME_ADVANTAGES.register("vtrace")
@torch.no_grad()
def vtrace_advantages(
    rewards: Tensor,  # [T, N]
    values: Tensor,  # [T, N] V(x_t), the learner's critic
    *,
    terminated: Tensor,  # [T, N] bool
    truncated: Tensor,  # [T, N] bool
    last_value: Tensor,  # [N] V(x_T)
    final_values: Tensor | None = None,  # [T, N], read only where truncated
    gamma: float = 0.99,
    lam: float = 1.0,
    bootstrap_truncated: bool = True,
    behaviour_logp: Tensor | None = None,  # [T, N] log mu(a|x), the fragment's
    target_logp: Tensor | None = None,  # [T, N] log pi(a|x), the learner's
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``vtrace`` as a ``GameAdvantageFn``: ``(pg_advantages, vs)`` for the fragment, the flags
    turned into discounts (gamma, 0 after a termination; with ``bootstrap_truncated=False`` also
    after a truncation). The game learner passes ``behaviour_logp`` / ``target_logp`` to every
    estimator that takes them; without them the data is taken as on-policy (ratio 1)."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    if (behaviour_logp is None) != (target_logp is None):
        raise ValueError("pass both behaviour_logp and target_logp, or neither (on-policy)")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    if behaviour_logp is None or target_logp is None:
        behaviour_logp = target_logp = torch.zeros_like(rewards, dtype=dtype)
    ends = terminated.bool() if bootstrap_truncated else terminated.bool() | truncated.bool()
    discounts = gamma * (~ends).to(dtype)  # [T, N]
    out = vtrace(
        behaviour_logp,
        target_logp,
        rewards,
        values,
        last_value,
        discounts,
        truncated=truncated if bootstrap_truncated else None,
        final_values=final_values,
        rho_bar=rho_bar,
        c_bar=c_bar,
        lam=lam,
    )
    return out.pg_advantages, out.vs
