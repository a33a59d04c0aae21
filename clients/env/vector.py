"""gymnasium views of a remote pool: `RemoteVectorEnv` (a VectorEnv over one session) and
`RemoteEnv` (an Env over a session of one env)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium.envs.registration import EnvSpec
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from clients.env.session import (
    InvalidSeedError,
    RemoteAttributeError,
    SessionInfo,
    SyncEnvSession,
)
from clients.env.types import EpisodeStats

# What get_attr/call can answer without the server: per-env attributes the client knows.
_LOCAL_ATTRS = ("action_space", "metadata", "observation_space", "render_mode", "spec")


class RemoteVectorEnv(gymnasium.vector.VectorEnv):
    """N environments on an env server, as a gymnasium VectorEnv.

    Conforms to SyncVectorEnv: NEXT_STEP autoreset by default (SAME_STEP, with final_obs and
    final_info infos, by option), reset(seed=int | list | None), float64 rewards, metadata with
    render_modes/render_fps/autoreset_mode, `spec`, and call/get_attr/set_attr for what the
    client knows (`call("render")`; other names raise RemoteAttributeError, an AttributeError).
    With copy=True (the default, as SyncVectorEnv) returned arrays are writable copies;
    copy=False returns read-only views. Ended episodes' returns and lengths, counted by the
    server, are in `last_episodes`.

    ``record_episode_statistics=True`` puts them into the step's infos as gymnasium's per-env
    ``RecordEpisodeStatistics`` wrapper does under SyncVectorEnv (the wrapper in an env factory
    never reaches the server): ``infos["episode"]`` (``"r"`` float64, ``"l"`` int64, ``"t"``
    float64 arrays with their ``"_r"``/``"_l"``/``"_t"`` masks) and the ``infos["_episode"]``
    mask; under SAME_STEP autoreset both are inside ``infos["final_info"]``, as there. Returns
    and lengths are the server's; ``"t"`` is the wall time this client saw the episode take.
    Not together with gymnasium's vector RecordEpisodeStatistics wrapper under NEXT_STEP,
    which refuses an existing "episode" key (as it does over SyncVectorEnv).

    ``colocated=True`` offers the server the co-located shared-memory ring (docs/colocated.md;
    `EnvSession.colocate`): when the server runs on this host and the spaces fit, steps skip
    gRPC. Else steps stay on gRPC; `transport` says which ("shm" or "grpc") and
    `colocate_reason` why not. The ring carries no per-env infos (SAME_STEP's ``final_info``
    is then empty), and with copy=False a step's views are overwritten two steps later.
    """

    def __init__(
        self,
        address: str,
        env_id: str,
        num_envs: int = 1,
        *,
        seed: int | None = None,
        kwargs: dict[str, Any] | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        render_mode: str | None = None,
        copy: bool = True,
        request_timeout_s: float = 120.0,
        record_episode_statistics: bool = False,
        colocated: bool = False,
    ) -> None:
        self._session = SyncEnvSession(address, request_timeout_s=request_timeout_s)
        self.colocate_reason = "not asked (colocated=False)" if not colocated else ""
        try:
            info = self._session.create(
                env_id,
                num_envs,
                seed=seed,
                kwargs=kwargs,
                autoreset_mode=autoreset_mode,
                render_mode=render_mode,
                float64_rewards=True,
            )
            # The caller steps this one session in lock step: wait for answers in the kernel,
            # as a lone actor does (sampler/actors/settings.py, colocated_block_us).
            if colocated and not self._session.colocate(slots=2, block_us=10_000):
                self.colocate_reason = self._session.session.colocate_reason
        except BaseException:
            self._session.close()
            raise
        self.info = info
        self.num_envs = info.num_envs
        self.single_observation_space = info.observation_space
        self.single_action_space = info.action_space
        self.observation_space = batch_space(info.observation_space, self.num_envs)
        self.action_space = batch_space(info.action_space, self.num_envs)
        self.render_mode = render_mode
        self.autoreset_mode = info.autoreset_mode
        self.spec = _spec(address, info, kwargs, request_timeout_s)
        self._env_metadata = _metadata(info)
        self.metadata = {**self._env_metadata, "autoreset_mode": info.autoreset_mode}
        self.copy = copy
        self.last_episodes: list[EpisodeStats] = []
        self.record_episode_statistics = record_episode_statistics
        self._episode_start = np.zeros(self.num_envs)  # perf_counter at each episode's start
        self._resets_next = np.zeros(self.num_envs, dtype=bool)  # NEXT_STEP: reset at next step

    @property
    def transport(self) -> str:
        """How steps travel: "shm" (the co-located ring) or "grpc"."""
        return self._session.session.transport

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset, as SyncVectorEnv: seed s seeds env i with s + i; a list gives env i seed[i]
        (None: keep its RNG). options["reset_mask"] resets only those envs."""
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        indices = np.flatnonzero(mask).tolist() if mask is not None else []
        if isinstance(seed, np.ndarray):
            seed = seed.tolist()
        if isinstance(seed, int | np.integer) and seed < 0:
            raise InvalidSeedError(f"seed must be >= 0 (gymnasium seeds), got {seed}", field="seed")
        if not (seed is None or isinstance(seed, int | np.integer)):
            # As SyncVectorEnv: anything else is a sequence of one seed per env (TypeError when
            # it has no length, ValueError when the length is wrong), each an int or None.
            if not hasattr(seed, "__len__"):
                raise TypeError(
                    f"seed must be an int, a list of one per env, or None; got {seed!r}"
                )
            if len(seed) != self.num_envs:
                raise ValueError(
                    "If seeds are passed as a list the length must match "
                    f"num_envs={self.num_envs} but got length={len(seed)}."
                )
            seed = list(seed)
            _check_seeds(seed)
            seeds = [seed[i] for i in indices] if mask is not None else seed
            seed = None if all(s is None for s in seeds) else seeds
        obs, infos = self._session.reset(seed=seed, env_indices=indices, options=options or None)
        started = indices if mask is not None else slice(None)
        self._episode_start[started] = time.perf_counter()
        self._resets_next[started] = False
        return self._out(obs), self._out(infos)

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        began = time.perf_counter()
        result = self._session.step(actions)
        self.last_episodes = result.episodes
        infos = self._out(result.infos)
        ended = result.terminated | result.truncated
        same_step = self.autoreset_mode is AutoresetMode.SAME_STEP
        if result.final_observations is not None:
            infos["final_obs"] = _rows(result.final_observations, ended)
            infos["_final_obs"] = ended.copy()
        if same_step and ended.any() and "final_info" not in infos:  # the ring carries no infos
            infos["final_info"], infos["_final_info"] = {}, ended.copy()
        if self.record_episode_statistics:
            self._record(infos, result.episodes, began, ended, same_step)
        return (
            self._out(result.observations),
            result.rewards.astype(np.float64),  # float32 on the wire; SyncVectorEnv's dtype
            np.array(result.terminated),
            np.array(result.truncated),
            infos,
        )

    def _record(
        self,
        infos: dict[str, Any],
        episodes: list[EpisodeStats],
        began: float,
        ended: np.ndarray,
        same_step: bool,
    ) -> None:
        """Add the ended episodes' statistics to `infos` where and as SyncVectorEnv puts those
        of per-env RecordEpisodeStatistics wrappers (its own `_add_info` builds them)."""
        now = time.perf_counter()
        self._episode_start[self._resets_next] = began  # NEXT_STEP: reset during this step
        stats: dict[str, Any] = {}
        for e in episodes:
            t = round(now - float(self._episode_start[e.env_index]), 6)
            episode = {"r": float(e.episode_return), "l": int(e.length), "t": t}
            stats = self._add_info(stats, {"episode": episode}, e.env_index)
        if same_step:
            self._episode_start[ended] = now
        else:
            self._resets_next = ended.copy()
        if not stats:
            return
        if same_step:
            infos["final_info"] = {**infos.get("final_info", {}), **stats}
        else:
            infos.update(stats)

    def _out(self, value: Any) -> Any:
        if not self.copy:
            return value
        if isinstance(value, np.ndarray):
            return value.copy()
        if isinstance(value, dict):
            return {k: self._out(v) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(self._out(v) for v in value)
        return value

    def render(self) -> tuple[np.ndarray, ...] | None:
        if self.render_mode != "rgb_array":
            return None
        return tuple(self._session.render(range(self.num_envs)))

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """SyncVectorEnv.call for what the client can do: "render" (each env's frame, or None
        without render_mode="rgb_array") and the attributes `get_attr` knows."""
        if name == "render":
            if args or kwargs:
                raise TypeError("render() takes no arguments")
            frames = self.render()
            return frames if frames is not None else (None,) * self.num_envs
        if args or kwargs:
            raise RemoteAttributeError(
                f"{name!r}: RemoteVectorEnv.call can call only 'render' on the remote envs",
                field=name,
            )
        return self.get_attr(name)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Each env's `name`, for attributes the client knows: the single spaces, render_mode,
        spec and metadata (the env's, without autoreset_mode); others raise
        RemoteAttributeError (an AttributeError)."""
        values = {
            "action_space": self.single_action_space,
            "observation_space": self.single_observation_space,
            "render_mode": self.render_mode,
            "spec": self.spec,
        }
        if name == "metadata":
            return tuple(dict(self._env_metadata) for _ in range(self.num_envs))
        if name not in values:
            raise RemoteAttributeError(
                f"{name!r}: the remote envs' attributes cannot be read over the wire; "
                f"get_attr knows {', '.join(_LOCAL_ATTRS)}",
                field=name,
            )
        return (values[name],) * self.num_envs

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Not possible over the wire: checks `values` as SyncVectorEnv does, then raises
        RemoteAttributeError (an AttributeError)."""
        if not isinstance(values, list | tuple):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        raise RemoteAttributeError(
            f"{name!r}: attributes of remote envs cannot be set over the wire "
            "(pass kwargs at creation instead)",
            field=name,
        )

    def close_extras(self, **kwargs: Any) -> None:
        self._session.close()


def _check_seeds(seeds: list[Any]) -> None:
    """Per-env seeds as gymnasium's seeding checks them (ints >= 0, or None; numpy ints pass)."""
    for s in seeds:
        if s is not None and not isinstance(s, int | np.integer):
            raise InvalidSeedError(
                f"seeds must be ints or None, got {type(s).__name__} {s!r}", field="seed"
            )
    if any(s is not None and s < 0 for s in seeds):
        raise InvalidSeedError(f"seeds must be >= 0 or None, got {seeds}", field="seed")


def _metadata(info: SessionInfo) -> dict[str, Any]:
    """An env's metadata as the server describes it: render_modes (and render_fps)."""
    out: dict[str, Any] = {"render_modes": list(info.render_modes)}
    if info.render_fps is not None:
        fps = info.render_fps
        out["render_fps"] = int(fps) if fps.is_integer() else fps
    return out


def _spec(
    address: str, info: SessionInfo, kwargs: dict[str, Any] | None, request_timeout_s: float
) -> EnvSpec:
    """An EnvSpec of one remote env: `gymnasium.make(spec)` (or spec.make()) opens a RemoteEnv
    of the same id on the same server."""
    entry = info.env
    spec_kwargs: dict[str, Any] = {"address": address, "env_id": entry.env_id}
    if kwargs:
        spec_kwargs["kwargs"] = dict(kwargs)
    if request_timeout_s != 120.0:
        spec_kwargs["request_timeout_s"] = request_timeout_s
    return EnvSpec(
        id=entry.env_id,
        entry_point=f"{RemoteEnv.__module__}:{RemoteEnv.__name__}",
        reward_threshold=entry.reward_threshold,
        max_episode_steps=entry.max_episode_steps or None,
        kwargs=spec_kwargs,
    )


def _rows(batch: Any, ended: np.ndarray) -> np.ndarray:
    """An object array of N per-env final observations (None where no episode ended)."""
    out = np.full(len(ended), None, dtype=object)
    for i in np.flatnonzero(ended).tolist():
        out[i] = _row(batch, i)
    return out


def _row(value: Any, i: int) -> Any:
    """Env i's entry of a batch, unbatched like the space (arrays copied, scalars as scalars)."""
    if isinstance(value, dict):
        return {k: _row(v, i) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_row(v, i) for v in value)
    if isinstance(value, list) or value.ndim == 1:
        return value[i]  # a string, or a numpy scalar (immutable: nothing to copy)
    return np.array(value[i])


class RemoteEnv(gymnasium.Env):
    """One environment on an env server, as a gymnasium Env (no autoreset, like a local Env).

    `np_random` is a local generator seeded like the remote env (reset(seed=...)), so code that
    samples from it is reproducible; the remote env's own generator cannot be read over the wire.
    `spec` makes another RemoteEnv of the same id on the same server (gymnasium.make(env.spec));
    `metadata` has the env's render_modes (those a server renders: "rgb_array") and render_fps.
    """

    # What the class can render (gymnasium.make reads it before an instance exists).
    metadata: dict[str, Any] = {"render_modes": ["rgb_array"]}

    def __init__(
        self,
        address: str,
        env_id: str,
        *,
        kwargs: dict[str, Any] | None = None,
        render_mode: str | None = None,
        request_timeout_s: float = 120.0,
    ) -> None:
        self._session = SyncEnvSession(address, request_timeout_s=request_timeout_s)
        try:
            info = self._session.create(
                env_id,
                1,
                kwargs=kwargs,
                autoreset_mode=AutoresetMode.DISABLED,
                render_mode=render_mode,
                float64_rewards=True,
            )
        except BaseException:
            self._session.close()
            raise
        self.info = info
        self.observation_space = info.observation_space
        self.action_space = info.action_space
        self.render_mode = render_mode
        self.metadata = _metadata(info)
        self.spec = _spec(address, info, kwargs, request_timeout_s)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        obs, infos = self._session.reset(seed=seed, options=options)
        return _row(obs, 0), _first_info(infos)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        result = self._session.step(_batch_one(self.action_space, action))
        return (
            _row(result.observations, 0),
            float(result.rewards[0]),
            bool(result.terminated[0]),
            bool(result.truncated[0]),
            _first_info(result.infos),
        )

    def render(self) -> np.ndarray | None:
        if self.render_mode != "rgb_array":
            return None
        return np.array(self._session.render([0])[0])

    def close(self) -> None:
        self._session.close()


def _batch_one(space: Any, action: Any) -> Any:
    """A batch of one action, in the space's dtype where the caller gave a Python value."""
    from gymnasium import spaces as gs

    if isinstance(space, gs.Dict):
        return {k: _batch_one(s, action[k]) for k, s in space.spaces.items()}
    if isinstance(space, gs.Tuple):
        return tuple(_batch_one(s, a) for s, a in zip(space.spaces, action, strict=True))
    if isinstance(space, gs.Text):
        return [action]
    array = np.asarray(action)
    if not isinstance(action, np.ndarray | np.generic):
        array = array.astype(space.dtype)  # a Python int/float/list carries no dtype of its own
    return array[None]


def _first_info(infos: dict[str, Any]) -> dict[str, Any]:
    """Env 0's entries of vector-style infos (keys whose "_key" mask is set for env 0)."""
    out: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_") or not infos.get(f"_{key}", np.ones(1, bool))[0]:
            continue
        if isinstance(value, dict):
            out[key] = _first_info(value)
        else:
            out[key] = value[0].item() if value.ndim == 1 else np.array(value[0])
    return out
