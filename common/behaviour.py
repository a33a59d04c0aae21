"""Behaviour policies of a game actor or a game link: what chooses the actions that go into a
fragment (sampler/actors and env_server/game_link share them).

Both act on the whole batch of the actor's N environments at once (one call per tick, never a
Python loop over envs) and report, per env, the action in the form the env takes, the action as
the fragment stores it (for Box actions the unclipped sample, whose log-probability the learner
recomputes), its behaviour log-probability and, when there is a critic, V(s).

- `RandomBehaviour`: uniform over the action space, seeded; no critic. The demo's policy.
- `TorchBehaviour`: the shared actor-critic (common.policies), whose weights come from the
  learner; `version` is the learner version loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from common.policy_config import PolicyConfig
from services.errors import InvalidArgument

__all__ = ["Behaviour", "Decision", "RandomBehaviour", "TorchBehaviour", "action_layout"]


@dataclass
class Decision:
    """The policy's choice for all N envs of one tick."""

    env_actions: np.ndarray  # [N, ...] what EnvService.Step gets
    actions: np.ndarray  # [N, ...] what the fragment stores
    logprobs: np.ndarray  # float32 [N]
    values: np.ndarray | None  # float32 [N]; None without a critic


class Behaviour(Protocol):
    """What the rollout loop needs from a policy."""

    version: int  # policy version that makes the decisions (0 for the random policy)
    has_values: bool  # whether decisions carry V(s) and `values` answers

    def act(self, obs: np.ndarray) -> Decision: ...

    def values(self, obs: np.ndarray) -> np.ndarray | None:
        """V(s) of a batch of observations, float32 [B]; None without a critic."""
        ...


def action_layout(space: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape (of one env's action) and dtype of the actions a fragment stores."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return (), np.dtype(np.int64)
    if isinstance(space, spaces.MultiDiscrete | spaces.MultiBinary):
        return tuple(space.shape), np.dtype(np.int64)
    if isinstance(space, spaces.Box):
        return tuple(space.shape), np.dtype(np.float32)
    raise InvalidArgument(
        f"game actor: action space {space} is not Discrete, MultiDiscrete, MultiBinary or Box",
        field="action_space",
    )


class RandomBehaviour:
    """Uniform random actions from a seeded generator, with their exact log-probabilities.

    Box dimensions with both bounds finite are uniform; unbounded ones standard normal and
    half-bounded ones bound + exponential(1), as gymnasium's Box.sample does.
    """

    version = 0
    has_values = False

    def __init__(self, action_space: Any, num_envs: int, seed: int | None) -> None:
        from gymnasium import spaces

        self.space = action_space
        self.num_envs = num_envs
        self.rng = np.random.default_rng(seed)
        shape, _ = action_layout(action_space)
        self._shape = (num_envs, *shape)
        self._logp_row: np.ndarray | None = None
        low: int | np.ndarray
        count: int | np.ndarray
        if isinstance(action_space, spaces.Discrete | spaces.MultiDiscrete | spaces.MultiBinary):
            # All three are integers uniform in [low, high) per component.
            if isinstance(action_space, spaces.Discrete):
                low, count = int(action_space.start), int(action_space.n)
            elif isinstance(action_space, spaces.MultiDiscrete):
                low, count = action_space.start.astype(np.int64), action_space.nvec
            else:
                low, count = 0, np.full(action_space.shape, 2)
            self._int_low, self._int_high = low, low + count
            self._sample = self._integers
            logp = -float(np.log(np.asarray(count, dtype=np.float64)).sum())
            self._logp_row = np.full(num_envs, logp, dtype=np.float32)  # constant: shared
        else:
            self._sample = self._box
            low = np.broadcast_to(action_space.low, action_space.shape).astype(np.float64)
            high = np.broadcast_to(action_space.high, action_space.shape).astype(np.float64)
            self._bounded = np.isfinite(low) & np.isfinite(high)
            self._below = np.isfinite(low) & ~np.isfinite(high)  # [low, inf)
            self._above = ~np.isfinite(low) & np.isfinite(high)  # (-inf, high]
            self._normal = ~np.isfinite(low) & ~np.isfinite(high)
            self._low = np.where(self._bounded | self._below, low, 0.0)  # finite stand-ins
            self._high = np.where(self._bounded | self._above, high, 1.0)
            self._logp = -float(np.log(self._high - self._low)[self._bounded].sum())

    def act(self, obs: np.ndarray) -> Decision:
        actions, logprobs = self._sample()
        env_actions = actions.astype(self.space.dtype, copy=False)  # MultiBinary wants int8
        return Decision(env_actions, actions, logprobs, None)

    def values(self, obs: np.ndarray) -> None:
        return None

    def _integers(self) -> tuple[np.ndarray, np.ndarray]:
        actions = self.rng.integers(self._int_low, self._int_high, size=self._shape)
        return actions, self._logp_row  # type: ignore[return-value]

    def _box(self) -> tuple[np.ndarray, np.ndarray]:
        out = self.rng.uniform(self._low, self._high, size=self._shape)
        logp = np.full(self.num_envs, self._logp)
        if not self._bounded.all():
            z = self.rng.standard_normal(self._shape)
            e = self.rng.exponential(size=self._shape)
            out = np.where(self._normal, z, out)
            out = np.where(self._below, self._low + e, out)
            out = np.where(self._above, self._high - e, out)
            per_dim = np.where(self._normal, -0.5 * z * z - 0.5 * math.log(2 * math.pi), 0.0)
            per_dim -= np.where(self._below | self._above, e, 0.0)
            logp += per_dim.reshape(self.num_envs, -1).sum(-1)
        return out.astype(self.space.dtype), logp.astype(np.float32)


class TorchBehaviour:
    """The shared actor-critic, run under torch.no_grad in float32 on `device`.

    Built exactly as the learner builds it (common.policies.build_policy) so the learner's
    state_dict loads by name. For discrete actions the actor samples from the network's logits
    itself (log-softmax + inverse CDF in numpy, seeded) instead of through
    `ActorCritic.evaluate`: torch.distributions' per-call overhead (argument validation, the
    entropy the actor does not need) cost several times the MLP forward at these batch sizes.
    The log-probabilities are the same function of the logits as Categorical.log_prob.
    Box actions go through `evaluate` (torch's generator, seeded).
    """

    has_values = True

    def __init__(
        self,
        observation_space: Any,
        action_space: Any,
        config: PolicyConfig,
        *,
        device: str = "cpu",
        seed: int | None = None,
    ) -> None:
        import torch

        from common.policies import build_policy

        if seed is not None:
            torch.manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.device = torch.device(device)
        self.net = build_policy(observation_space, action_space, config).to(self.device).eval()
        self.action_space = action_space
        self.action_dims: list[int] = list(self.net.action_dims)
        if self.action_dims:
            self.net.action_offset = self.net.action_offset.to(self.device)
            self._offset = self.net.action_offset.cpu().numpy().astype(np.int64)
            self._edges = np.cumsum([0, *self.action_dims])
        self.version = 0
        self._torch = torch

    def load(self, state_dict: dict[str, Any], version: int) -> None:
        """Take the learner's weights for `version` (names must match exactly)."""
        torch = self._torch
        state = {
            k: torch.as_tensor(v).to(self.device, torch.float32) for k, v in state_dict.items()
        }
        missing, unexpected = self.net.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise InvalidArgument(
                f"weights of version {version} do not fit the actor's policy: missing "
                f"{sorted(missing)}, unexpected {sorted(unexpected)}; do policy_config and the "
                "learner's network settings agree?",
                field="policy_config",
            )
        self.version = int(version)

    def _tensor(self, obs: np.ndarray) -> Any:
        x = self._torch.from_numpy(np.ascontiguousarray(obs)).to(self.device)
        return x if x.dtype == self._torch.uint8 else x.float()

    def act(self, obs: np.ndarray) -> Decision:
        if not self.action_dims:
            return self._act_continuous(obs)
        net = self.net
        with self._torch.no_grad():
            features = net.trunk(self._tensor(obs))
            logits = net.actor(features).cpu().numpy()
            values = net.critic(features).squeeze(-1).cpu().numpy()
        n = logits.shape[0]
        heads = len(self.action_dims)
        actions = np.empty((n, heads), dtype=np.int64)
        logp = np.zeros(n, dtype=np.float64)
        rows = np.arange(n)
        for k in range(heads):  # one per action component, not per env
            part = logits[:, self._edges[k] : self._edges[k + 1]].astype(np.float64)
            part -= part.max(axis=1, keepdims=True)
            log_probs = part - np.log(np.exp(part).sum(axis=1, keepdims=True))
            cdf = np.exp(log_probs).cumsum(axis=1)
            u = self.rng.random((n, 1)) * cdf[:, -1:]  # scaled: rounding never overshoots
            choice = np.minimum((u >= cdf).sum(axis=1), self.action_dims[k] - 1)
            actions[:, k] = choice
            logp += log_probs[rows, choice]
        actions += self._offset
        if heads == 1 and self.action_space.shape == ():
            actions = actions[:, 0]
        else:
            actions = actions.reshape(n, *self.action_space.shape)
        return Decision(
            env_actions=actions,
            actions=actions,
            logprobs=logp.astype(np.float32),
            values=values.astype(np.float32, copy=False),
        )

    def _act_continuous(self, obs: np.ndarray) -> Decision:
        with self._torch.no_grad():
            action, logp, _, value = self.net.evaluate(self._tensor(obs))
            env_actions = self.net.to_env_action(action)
        return Decision(
            env_actions=env_actions,
            actions=action.cpu().numpy().astype(np.float32, copy=False),
            logprobs=logp.cpu().numpy().astype(np.float32, copy=False),
            values=value.cpu().numpy().astype(np.float32, copy=False),
        )

    def values(self, obs: np.ndarray) -> np.ndarray:
        with self._torch.no_grad():
            return self.net.value(self._tensor(obs)).cpu().numpy().astype(np.float32, copy=False)
