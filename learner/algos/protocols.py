"""The call signature of each algorithm family: one ``Protocol`` per typed registry.

A registry (``learner.algos.registry``) checks every function registered in it against its
family's ``__call__`` (``check_signature``): the leading parameters must have the same names and
order, keyword-only ones must be accepted by name, parameters with a default here must have one
there, and any further parameter (a hyperparameter, passed from a preset's ``*_kwargs``) must have
a default. So a function of the wrong family (``gae`` as a group advantage, ``a2c`` with its
arguments in another order) fails when it is registered, and a preset naming it fails when it is
validated, not at call time.

Shapes: ``B`` sequences (or rows of a minibatch), ``T`` tokens (or, for game RL, time steps of a
fragment), ``N`` environments. Metrics are detached 0-dim tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "AggregationFn",
    "GameAdvantageFn",
    "GroupAdvantageFn",
    "KLEstimatorFn",
    "PolicyLossFn",
    "ScheduleFn",
]


class GameAdvantageFn(Protocol):
    """Advantages over a fixed-length rollout fragment of N envs (``gae``); the game learner
    calls it with these keywords, without gradient."""

    def __call__(
        self,
        rewards: Tensor,  # [T, N] r_t
        values: Tensor,  # [T, N] V(s_t)
        *,
        terminated: Tensor,  # [T, N] bool: true end of the episode at step t
        truncated: Tensor,  # [T, N] bool: cut at step t (time limit)
        last_value: Tensor,  # [N] V(s_T) after the last step
        final_values: Tensor | None = None,  # [T, N] V(final observation), read where truncated
        gamma: float = 0.99,
        lam: float = 0.95,
        bootstrap_truncated: bool = True,
    ) -> tuple[Tensor, Tensor]:  # (advantages [T, N], returns [T, N]: value targets)
        ...


class GroupAdvantageFn(Protocol):
    """Group-relative advantages of LM completions (``grpo``, ``rloo``, ``reinforce_pp``, ...)."""

    def __call__(
        self,
        rewards: Tensor,  # [B] float: one scalar reward per completion
        group_ids: Tensor,  # [B] int64: completions with one id answer the same prompt
        mask: Tensor,  # [B, T] bool: completion tokens that are trained on
        **hyperparameters: Any,  # preset.advantage_kwargs (and token_rewards [B, T] if taken)
    ) -> tuple[Tensor, dict[str, Tensor]]:  # (advantages [B, T] zero where masked, metrics)
        ...


class PolicyLossFn(Protocol):
    """A per-entry policy loss to minimise (``ppo``, ``a2c``, ``gspo``, ``cispo``, ``sapo``)."""

    def __call__(
        self,
        logp: Tensor,  # [B, T] (game RL: [B]) log pi_theta of the taken tokens/actions
        old_logp: Tensor,  # same shape: log pi_old, the behaviour policy
        adv: Tensor,  # same shape (or broadcastable): advantages
        mask: Tensor | None = None,  # same shape, bool: entries that count (metrics; gspo needs it)
        **hyperparameters: Any,  # preset.loss_kwargs
    ) -> tuple[Tensor, dict[str, Tensor]]:  # (loss shaped as logp, unreduced; metrics)
        ...


class AggregationFn(Protocol):
    """Reduces a per-entry loss to the scalar that is back-propagated (``token-mean``, ...)."""

    def __call__(
        self,
        loss: Tensor,  # [B, T] per-entry loss
        mask: Tensor,  # [B, T] bool: entries that count
        **hyperparameters: Any,  # preset.aggregation_kwargs (e.g. norm)
    ) -> Tensor:  # 0-dim
        ...


class KLEstimatorFn(Protocol):
    """A per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (``k1``..``k3``)."""

    def __call__(
        self,
        logp: Tensor,  # [B, T] log pi_theta of the sampled tokens
        ref_logp: Tensor,  # [B, T] log pi_ref of the same tokens
    ) -> Tensor:  # [B, T]
        ...


class ScheduleFn(Protocol):
    """A scalar (learning rate, CHORD's mu, ...) as a function of the update step."""

    def __call__(
        self,
        step: int,  # >= 0
        total: int,  # steps until ``end`` is reached
        start: float,  # value at step 0 (after any warm-up)
        end: float = 0.0,  # value from ``total`` on
        **hyperparameters: Any,  # keyword-only extras (warmup_cosine's warmup)
    ) -> float: ...
