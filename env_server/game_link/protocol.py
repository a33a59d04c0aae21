"""Validation of what a game sends: Hello against the server's limits, every ObservationBatch
against the spaces and number of agents its Hello declared.

Every check raises services.errors.InvalidArgument (or ResourceExhausted for limits) naming the
offending field in the proto's terms, e.g. "observations.observations" or "hello.num_agents";
the servicer turns it into the response's in-band google.rpc.Status with a BadRequest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import spaces, tensor
from common.behaviour import action_layout
from rlfleet.env.v1 import game_link_pb2
from services.errors import InvalidArgument, ResourceExhausted

__all__ = ["PROTOCOL_VERSIONS", "LinkSpec", "Tick", "TickCursor", "check_hello", "check_tick"]

PROTOCOL_VERSIONS = (1,)
_ENV_ID = re.compile(r"[A-Za-z0-9._/-]{1,128}")
MAX_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE = 32, 64, 256


@dataclass(frozen=True)
class LinkSpec:
    """What a Hello declared, checked."""

    game: str
    env_id: str
    observation_space: Any  # gymnasium space of one agent
    action_space: Any
    num_agents: int
    session_key: str
    max_in_flight: int  # requested (>= 1)
    labels: dict[str, str] = field(default_factory=dict)

    def differs_from(self, other: LinkSpec) -> str | None:
        """Why `other` cannot resume a link opened with this spec, or None when it can."""
        for name in ("game", "env_id", "num_agents"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} {getattr(other, name)!r} is not {getattr(self, name)!r}"
        if self.observation_space != other.observation_space:
            return "the observation space differs"
        if self.action_space != other.action_space:
            return "the action space differs"
        return None


def check_hello(hello: game_link_pb2.Hello, *, max_agents: int) -> LinkSpec:
    """The link a Hello asks for; InvalidArgument/ResourceExhausted naming the field otherwise."""
    if hello.protocol_version not in PROTOCOL_VERSIONS:
        speaks = ", ".join(map(str, PROTOCOL_VERSIONS))
        raise InvalidArgument(
            f"protocol_version {hello.protocol_version} is not spoken here; this server speaks "
            f"{speaks} (set Hello.protocol_version)",
            field="hello.protocol_version",
        )
    if not 1 <= len(hello.game) <= 128:
        raise InvalidArgument("game must be 1 to 128 characters", field="hello.game")
    if not _ENV_ID.fullmatch(hello.env_id):
        raise InvalidArgument(
            f"env_id {hello.env_id!r} must be 1 to 128 characters of [A-Za-z0-9._/-]",
            field="hello.env_id",
        )
    if len(hello.session_key) > 128:
        raise InvalidArgument("session_key is over 128 characters", field="hello.session_key")
    if hello.num_agents < 1:
        raise InvalidArgument("num_agents must be >= 1", field="hello.num_agents")
    if hello.num_agents > max_agents:
        raise ResourceExhausted(
            f"num_agents={hello.num_agents} is over this server's max_agents_per_link={max_agents}",
            field="hello.num_agents",
        )
    _check_labels(dict(hello.labels))
    observation_space = spaces.from_proto(hello.observation_space, name="hello.observation_space")
    action_space = spaces.from_proto(hello.action_space, name="hello.action_space")
    _check_supported(observation_space, action_space)
    return LinkSpec(
        game=hello.game,
        env_id=hello.env_id,
        observation_space=observation_space,
        action_space=action_space,
        num_agents=int(hello.num_agents),
        session_key=hello.session_key,
        max_in_flight=max(1, int(hello.max_in_flight)),
        labels=dict(hello.labels),
    )


def _check_labels(labels: dict[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"{len(labels)} labels, at most {MAX_LABELS}", field="hello.labels")
    for key, value in labels.items():
        if len(key) > MAX_LABEL_KEY or len(value) > MAX_LABEL_VALUE:
            raise InvalidArgument(
                f"label {key[:64]!r}: keys up to {MAX_LABEL_KEY} and values up to "
                f"{MAX_LABEL_VALUE} characters",
                field=f"hello.labels.{key[:64]}",
            )


def _check_supported(observation_space: Any, action_space: Any) -> None:
    """The policy networks (common.policies) and fragments take one array per agent."""
    from gymnasium import spaces as gym_spaces

    if not isinstance(observation_space, gym_spaces.Box):
        raise InvalidArgument(
            f"observation space {observation_space} is not supported by this server: the "
            "policy takes one Box observation per agent",
            field="hello.observation_space",
        )
    try:
        action_layout(action_space)
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, field="hello.action_space") from None


@dataclass
class Tick:
    """One checked ObservationBatch: arrays with leading dimension N."""

    tick: int
    obs: np.ndarray  # [N, *obs]
    rewards: np.ndarray  # float32 [N]
    terminated: np.ndarray  # bool [N]
    truncated: np.ndarray  # bool [N], False where terminated (termination wins)
    episode_ids: np.ndarray  # int64 [N]
    # float64 [N]: infos["score"] of the agents that reported one (their "_score" mask), NaN
    # elsewhere; None when no agent did. Read by the recorder when an episode ends.
    scores: np.ndarray | None = None

    @property
    def done(self) -> np.ndarray:
        return self.terminated | self.truncated


@dataclass
class TickCursor:
    """What the next batch is checked against: the last accepted tick and episode rows."""

    tick: int | None = None
    episode_ids: np.ndarray | None = None
    done: np.ndarray | None = None

    def advance(self, tick: Tick) -> None:
        self.tick, self.episode_ids, self.done = tick.tick, tick.episode_ids, tick.done


def check_tick(
    batch: game_link_pb2.ObservationBatch,
    spec: LinkSpec,
    cursor: TickCursor,
    *,
    clip: bool = False,
) -> Tick:
    """Decode and check one batch; the cursor is not moved (the caller advances it).

    NaN/inf observations are refused like NaN rewards, naming the agent (its row) and the
    field, unless `clip` (the env server's nonfinite_observations) replaces them."""
    n = spec.num_agents
    if cursor.tick is not None and batch.tick <= cursor.tick:
        raise InvalidArgument(
            f"tick {batch.tick} does not increase: the previous tick was {cursor.tick}",
            field="observations.tick",
        )
    space = spec.observation_space
    obs_spec = spaces.batch_specs(space, n, name="observations.observations")
    obs = tensor.decode_tree(batch.observations, name="observations.observations")
    if not isinstance(obs, np.ndarray):
        raise InvalidArgument(
            "observations.observations: expected one tensor (a Box space), got a "
            f"{type(obs).__name__}",
            field="observations.observations",
        )
    tensor.check(obs, obs_spec)  # type: ignore[arg-type]
    obs = spaces.finite_observations(
        space, obs, name="observations.observations", who="agent", clip=clip
    )
    rewards = _leaf(batch, "rewards", np.float32, n)
    if not np.isfinite(rewards).all():
        bad = int(np.flatnonzero(~np.isfinite(rewards))[0])
        raise InvalidArgument(
            f"observations.rewards: agent {bad} reward {rewards[bad]} is not finite",
            field="observations.rewards",
        )
    terminated = _leaf(batch, "terminated", np.bool_, n)
    truncated = _leaf(batch, "truncated", np.bool_, n) & ~terminated
    episode_ids = _leaf(batch, "episode_ids", np.int64, n)
    if cursor.done is not None and cursor.episode_ids is not None:
        reused = cursor.done & (episode_ids == cursor.episode_ids)
        if reused.any():
            agent = int(np.flatnonzero(reused)[0])
            raise InvalidArgument(
                f"observations.episode_ids: agent {agent} ended episode {episode_ids[agent]} "
                "at the previous tick; its next row must carry a new episode id",
                field="observations.episode_ids",
            )
    scores = None
    if batch.HasField("infos"):
        infos = tensor.decode_tree(batch.infos, name="observations.infos")
        scores = _scores(infos, n)
    return Tick(int(batch.tick), obs, rewards, terminated, truncated, episode_ids, scores)


def _scores(infos: Any, n: int) -> np.ndarray | None:
    """infos["score"] as float64 [N], NaN where its "_score" mask is unset or the value is not
    finite; None when there is none. A score that is not [N] real numbers is ignored like any
    other info the server does not read (infos are free-form extras)."""
    if not isinstance(infos, dict):
        return None
    score = infos.get("score")
    if not isinstance(score, np.ndarray) or score.shape != (n,) or score.dtype.kind not in "iuf":
        return None
    out = score.astype(np.float64)
    mask = infos.get("_score")
    if isinstance(mask, np.ndarray) and mask.shape == (n,) and mask.dtype == np.bool_:
        out[~mask] = np.nan
    out[~np.isfinite(out)] = np.nan
    return out


def _leaf(batch: Any, name: str, dtype: Any, n: int) -> np.ndarray:
    path = f"observations.{name}"
    if not batch.HasField(name):
        raise InvalidArgument(f"{path}: missing ({np.dtype(dtype)} [{n}])", field=path)
    array = tensor.decode(getattr(batch, name), name=path)
    tensor.check(array, tensor.spec(path, np.dtype(dtype), [n]))
    return array
