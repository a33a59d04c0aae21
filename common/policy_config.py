"""The game policy's architecture, as both the actors' and the learner's settings name it.

Torch-free on purpose: run configs are validated (and so this is imported) before any process
starts, and that must not pay for importing torch. `common.policies` builds the network.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.config import StrictModel

__all__ = ["PolicyConfig"]


class PolicyConfig(StrictModel):
    """Architecture knobs; must be identical on actors and learner, since actors load the
    learner's state_dict into the module they build from these."""

    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: Literal["tanh", "relu"] = "tanh"
    init_log_std: float = 0.0  # Gaussian heads (Box actions)
    extra: dict[str, Any] = Field(default_factory=dict)
