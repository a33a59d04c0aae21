"""Game policy networks shared by actors (sampling) and the learner (training).

Both sides build the same module from the environment's spaces and a `PolicyConfig`, and exchange
its `state_dict` by name, so weights move between services without pickling code. Layout follows
CleanRL: separate actor and critic MLPs for vector observations (orthogonal init, policy head gain
0.01, value head gain 1), a shared Nature-CNN trunk for image observations.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Normal

from common.policy_config import PolicyConfig
from services.errors import InvalidArgument

__all__ = ["ActorCritic", "NatureCNN", "PolicyConfig", "build_policy", "categorical_entropy"]


def _layer(inp: int, out: int, gain: float = math.sqrt(2)) -> nn.Linear:
    layer = nn.Linear(inp, out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def _mlp(inp: int, hidden: tuple[int, ...], out: int, out_gain: float, act: str) -> nn.Sequential:
    activation = {"tanh": nn.Tanh, "relu": nn.ReLU}[act]
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [_layer(inp, size), activation()]
        inp = size
    layers.append(_layer(inp, out, out_gain))
    return nn.Sequential(*layers)


def _is_image(space: Any) -> bool:
    return len(space.shape) == 3 and space.dtype == np.uint8


class NatureCNN(nn.Module):
    """Mnih et al. 2015 trunk; input uint8 [B, H, W, C], output [B, 512]."""

    def __init__(self, shape: tuple[int, int, int]):
        super().__init__()
        h, w, c = shape
        self.conv = nn.Sequential(
            _layer_conv(c, 32, 8, 4), nn.ReLU(),
            _layer_conv(32, 64, 4, 2), nn.ReLU(),
            _layer_conv(64, 64, 3, 1), nn.ReLU(),
            nn.Flatten(),
        )  # fmt: skip
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, c, h, w)).shape[1]
        self.fc = nn.Sequential(_layer(flat, 512), nn.ReLU())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.permute(0, 3, 1, 2).float() / 255.0  # [B, C, H, W]
        return self.fc(self.conv(x))


def _layer_conv(inp: int, out: int, kernel: int, stride: int) -> nn.Conv2d:
    conv = nn.Conv2d(inp, out, kernel, stride)
    nn.init.orthogonal_(conv.weight, math.sqrt(2))
    assert conv.bias is not None  # Conv2d has a bias unless built with bias=False
    nn.init.constant_(conv.bias, 0.0)
    return conv


class ActorCritic(nn.Module):
    """Policy and value function for Box observations and Discrete/MultiDiscrete/Box actions."""

    def __init__(self, observation_space: Any, action_space: Any, config: PolicyConfig):
        super().__init__()
        from gymnasium import spaces

        if not isinstance(observation_space, spaces.Box):
            raise InvalidArgument(
                f"policy: observation space {observation_space} is not a Box; flatten it first",
                field="observation_space",
            )
        self.action_space = action_space
        if isinstance(action_space, spaces.Discrete):
            self.action_dims: list[int] = [int(action_space.n)]
            self.action_offset = torch.tensor([int(action_space.start)])
        elif isinstance(action_space, spaces.MultiDiscrete):
            self.action_dims = [int(n) for n in np.asarray(action_space.nvec).reshape(-1)]
            self.action_offset = torch.as_tensor(np.asarray(action_space.start).reshape(-1))
        elif isinstance(action_space, spaces.Box):
            self.action_dims = []
            self.continuous_shape = tuple(action_space.shape)
        else:
            raise InvalidArgument(
                f"policy: action space {action_space} is not Discrete, MultiDiscrete or Box",
                field="action_space",
            )
        out = sum(self.action_dims) or int(np.prod(action_space.shape))
        hidden, act = tuple(config.hidden_sizes), config.activation
        if _is_image(observation_space):
            h, w, c = observation_space.shape  # _is_image: three dimensions
            self.trunk: nn.Module = NatureCNN((h, w, c))
            self.actor: nn.Module = _layer(512, out, 0.01)
            self.critic: nn.Module = _layer(512, 1, 1.0)
        else:
            inp = int(np.prod(observation_space.shape))
            self.trunk = nn.Flatten()
            self.actor = _mlp(inp, hidden, out, 0.01, act)
            self.critic = _mlp(inp, hidden, 1, 1.0, act)
        if not self.action_dims:
            self.log_std = nn.Parameter(torch.full((1, out), float(config.init_log_std)))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """State value, [B]."""
        return self.critic(self.trunk(obs.float() if obs.dtype != torch.uint8 else obs)).squeeze(-1)

    def evaluate(
        self, obs: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action, log_prob [B], entropy [B], value [B]); samples an action when none is given."""
        x = obs if obs.dtype == torch.uint8 else obs.float()
        features = self.trunk(x)
        out = self.actor(features)
        value = self.critic(features).squeeze(-1)
        if self.action_dims:
            # Categorical's quantities from the log-softmax directly: torch.distributions'
            # per-call overhead (argument checks, broadcasting) dominates a small policy head's
            # forward and backward.
            heads = torch.split(out, self.action_dims, dim=-1)
            log_ps = [torch.log_softmax(head, -1) for head in heads]  # K x [B, n_k]
            if action is None:
                parts = [torch.multinomial(lp.exp(), 1, replacement=True) for lp in log_ps]
                action = torch.cat(parts, dim=-1) + self.action_offset  # [B, K]
            act = action.reshape(action.shape[0], -1).long() - self.action_offset  # [B, K]
            logp = sum(lp.gather(-1, act[:, i : i + 1]).squeeze(-1) for i, lp in enumerate(log_ps))
            entropy = sum(categorical_entropy(lp) for lp in log_ps)
            if len(self.action_dims) == 1 and action.dim() > 1:
                action = action.reshape(-1)
            return action, logp, entropy, value  # type: ignore[return-value]
        dist = Normal(out, self.log_std.expand_as(out).exp())
        flat = dist.sample() if action is None else action.reshape(action.shape[0], -1).float()
        logp = dist.log_prob(flat).sum(-1)
        entropy = dist.entropy().sum(-1)
        return flat.reshape(-1, *self.continuous_shape), logp, entropy, value

    def to_env_action(self, action: torch.Tensor) -> np.ndarray:
        """Actions as the environment expects them (Box actions clipped to bounds, int64 ids)."""
        if self.action_dims:
            return action.cpu().numpy().astype(np.int64)
        low, high = self.action_space.low, self.action_space.high
        return np.clip(action.cpu().numpy(), low, high).astype(self.action_space.dtype)


def categorical_entropy(log_p: torch.Tensor) -> torch.Tensor:
    """Entropy [B] of categoricals given as log-probabilities [B, n] (as Categorical.entropy:
    a log-probability of -inf, a masked action, counts as the smallest float, so 0 * it is 0)."""
    return -(log_p.clamp(min=torch.finfo(log_p.dtype).min) * log_p.exp()).sum(-1)


def build_policy(observation_space: Any, action_space: Any, config: PolicyConfig) -> ActorCritic:
    """The one constructor both sides call."""
    return ActorCritic(observation_space, action_space, config)
