"""Plain types shared by the env server and its clients: what a step returns, an ended episode,
an entry of the environment list. The server's pool and registry build them; clients receive
them. No gRPC, no environments: importing this is cheap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfleet.env.v1 import env_pb2

__all__ = ["EnvEntry", "EpisodeStats", "Message", "StepResult", "TextStepResult", "TextTurn"]

# An OpenAI chat message as a plain dict: {"role", "content"}, plus "tool_calls" on assistant
# messages and "tool_call_id" / "name" on tool messages (text environments' observations and
# actions).
Message = dict[str, Any]
ENV_KINDS = {env_pb2.ENV_KIND_TENSOR: "tensor", env_pb2.ENV_KIND_TEXT: "text"}


@dataclass(frozen=True)
class EnvEntry:
    """One creatable environment (what ListEnvs answers, and what `rlfleet envs` prints)."""

    env_id: str
    source: str  # "gymnasium" or "plugin:<entry point name>"
    max_episode_steps: int = 0  # 0 = unlimited or unknown
    reward_threshold: float | None = None
    kind: str = "tensor"  # or "text": a TextEnv (chat messages in and out)

    def to_proto(self) -> env_pb2.EnvInfo:
        return env_pb2.EnvInfo(
            env_id=self.env_id,
            source=self.source,
            max_episode_steps=self.max_episode_steps,
            reward_threshold=self.reward_threshold,
            kind=env_pb2.ENV_KIND_TEXT if self.kind == "text" else env_pb2.ENV_KIND_TENSOR,
        )

    @classmethod
    def from_proto(cls, msg: env_pb2.EnvInfo) -> EnvEntry:
        threshold = msg.reward_threshold if msg.HasField("reward_threshold") else None
        kind = ENV_KINDS.get(msg.kind, "tensor")  # UNSPECIFIED: a server before text envs
        return cls(msg.env_id, msg.source, msg.max_episode_steps, threshold, kind)


@dataclass(frozen=True)
class EpisodeStats:
    """An episode that ended at this step."""

    env_index: int
    episode_return: float
    length: int
    truncated: bool
    score: float | None = None  # the env's info["score"] at the episode's end, if numeric


@dataclass
class StepResult:
    """One lock step of N environments (gymnasium vector conventions)."""

    observations: Any  # batched like the observation space, leading dimension N
    rewards: np.ndarray  # float32 [N] (float64 when the session asked for float64 rewards)
    terminated: np.ndarray  # bool [N]
    truncated: np.ndarray  # bool [N]
    infos: dict[str, Any]  # vector-style numeric infos; SAME_STEP adds final_info/_final_info
    final_observations: Any = None  # SAME_STEP only, when an episode ended: zeros elsewhere
    episodes: list[EpisodeStats] = field(default_factory=list)


@dataclass
class TextTurn:
    """What one text environment said at a reset or step: its messages and info."""

    env_index: int
    messages: list[Message]
    info: dict[str, Any]


@dataclass
class TextStepResult:
    """One step of some text environments, in the order of the step's env indices."""

    env_indices: list[int]
    rewards: list[float]
    terminated: list[bool]
    truncated: list[bool]
    turns: list[TextTurn]
    episodes: list[EpisodeStats] = field(default_factory=list)
