"""A pool of N environments of one session, stepped in lock step.

This is a lean loop rather than `gymnasium.vector.SyncVectorEnv`, with the same semantics step
for step (seeds seed+i, autoreset modes, the order of reset calls; tests/contract compare the two
on CartPole), and it gives what the servicer needs and SyncVectorEnv does not: episode return and
length per env, final observations as one batch, resetting a subset of envs with seed + i, and a
clean error (not an assert) when a DISABLED-mode env is stepped past its end. Its bookkeeping is
per step, not per env, so it pays off with many envs and costs a little with one.

Not thread-safe: one session drives one pool, one request at a time.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, SupportsFloat

import numpy as np

from clients.env.types import EpisodeStats, StepResult
from common.spaces import finite_observations
from services.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    import gymnasium
    from gymnasium.vector import AutoresetMode

__all__ = ["EnvPool", "check_seeds", "env_indices"]


class EnvPool:
    """N environments made by `make_env()`, reset and stepped as one batch."""

    def __init__(
        self,
        make_env: Callable[[], gymnasium.Env],
        num_envs: int,
        *,
        autoreset_mode: AutoresetMode,
        seed: int | None = None,
        float64_rewards: bool = False,
        nonfinite_observations: str = "refuse",
    ) -> None:
        from gymnasium import spaces
        from gymnasium.vector import AutoresetMode

        self.envs: list[gymnasium.Env] = []
        try:
            for _ in range(num_envs):
                self.envs.append(make_env())
        except BaseException:
            self.close()
            raise
        self.num_envs = num_envs
        self.autoreset_mode = autoreset_mode
        self._same_step = autoreset_mode == AutoresetMode.SAME_STEP
        self._next_step = autoreset_mode == AutoresetMode.NEXT_STEP
        self.observation_space = self.envs[0].observation_space
        self._box_observations = isinstance(self.observation_space, spaces.Box)
        self.action_space = self.envs[0].action_space
        self.render_mode = self.envs[0].render_mode
        self.metadata: dict[str, Any] = dict(getattr(self.envs[0], "metadata", None) or {})
        self.float64_rewards = float64_rewards  # else float32 (StepResult.rewards)
        # NaN/inf in what the envs return: "refuse" (InvalidArgument, the pool must be reset) or
        # "clip" (common.spaces.finite_observations).
        self._clip_nonfinite = nonfinite_observations == "clip"
        for i, env in enumerate(self.envs[1:], 1):
            if env.observation_space != self.observation_space:
                self.close()
                raise InvalidArgument(f"env {i} has another observation space than env 0")
        self._first_seed = seed  # seeds the first reset when it brings none of its own
        self._obs: list[Any] = [None] * num_envs
        self._ended = np.zeros(num_envs, dtype=bool)  # episode over, env not reset yet
        self._returns = np.zeros(num_envs, dtype=np.float64)
        self._lengths = np.zeros(num_envs, dtype=np.int64)
        self._started = False  # a reset has happened (and no env failed since)
        self.total_steps = 0

    def reset(
        self,
        *,
        seed: int | None = None,
        seeds: Sequence[int | None] | None = None,
        indices: Sequence[int] = (),
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all envs (or `indices`); env i gets seed + i. Returns all N observations.

        ``seeds`` (instead of ``seed``) gives the k-th env reset its own seed (None: keep its
        RNG). ``indices`` are checked (at most N, each once, in range) before any env is reset;
        an env raising ValueError/TypeError/AssertionError on given ``options`` is
        InvalidArgument.
        """
        targets = self._targets(indices, "reset.env_indices") or range(self.num_envs)
        check_seeds(seed, seeds, len(targets))
        if not self._started and not indices:
            seed = self._first_seed if seed is None and seeds is None else seed
            self._first_seed = None
        elif not self._started:
            raise FailedPrecondition("reset all environments before resetting some")
        infos: dict[str, Any] = {}
        self._started = False  # stays False if an env raises half way
        if seeds is None:
            seeds = [None if seed is None else seed + i for i in targets]
        for i, env_seed in zip(targets, seeds, strict=True):
            try:
                self._obs[i], info = self.envs[i].reset(seed=env_seed, options=options)
            except (ValueError, TypeError, AssertionError) as exc:
                if not options:
                    raise
                raise InvalidArgument(
                    f"env {i} rejected the reset options: {type(exc).__name__}: {exc}",
                    field="reset.options",
                ) from exc
            if info:
                _add_info(infos, info, i, self.num_envs)
        self._ended[targets] = False
        self._returns[targets] = 0.0
        self._lengths[targets] = 0
        observations = self._finite(_stack(self.observation_space, self._obs), "reset")
        self._started = True
        return observations, infos

    def step(self, actions: Any, *, observations_out: np.ndarray | None = None) -> StepResult:
        """Step every env with its row of `actions` (already validated against action_space).

        With `observations_out` (Box spaces: an [N, *shape] array of the space's dtype, such as
        a co-located ring's slot) the observations are stacked into it rather than a new array.
        """
        if not self._started:
            raise FailedPrecondition("step before reset: send a ResetRequest first")
        if not self._same_step and not self._next_step and self._ended.any():
            ended = np.flatnonzero(self._ended).tolist()
            raise FailedPrecondition(
                f"envs {ended} ended their episode; reset them before stepping (DISABLED mode)"
            )
        n = self.num_envs
        # Python lists in the loop, one conversion after it: per-element numpy stores cost
        # about as much as the rest of the loop's bookkeeping together.
        rewards: list[SupportsFloat] = [0.0] * n  # as the envs return them (gymnasium's type)
        terminated, truncated = [False] * n, [False] * n
        stepped: list[bool] | None = None  # None: every env stepped (no NEXT_STEP resets)
        infos: dict[str, Any] = {}
        finals: dict[int, Any] = {}
        scores: dict[int, float] = {}  # info["score"] of the envs whose episode ended
        obs, same_step = self._obs, self._same_step
        resets = self._ended.tolist() if self._next_step and self._ended.any() else None
        if resets is not None:
            stepped = [not reset for reset in resets]
        self._started = False  # stays False if an env raises half way: the client must reset
        per_env = _unbatch(actions, n)
        for i, (env, action) in enumerate(zip(self.envs, per_env, strict=True)):
            if resets and resets[i]:
                obs[i], info = env.reset()
            else:
                obs[i], rewards[i], term, trunc, info = env.step(action)
                if term or trunc:
                    terminated[i], truncated[i] = term, trunc
                    if info and (score := _score(info)) is not None:
                        scores[i] = score
                    if same_step:
                        finals[i] = obs[i]
                        _add_info(infos, {"final_info": info}, i, n)
                        obs[i], info = env.reset()
            if info:
                _add_info(infos, info, i, n)
        result = self._account(
            obs, rewards, terminated, truncated, stepped, infos, finals, observations_out, scores
        )
        self._started = True  # after the observations passed: a refused step needs a reset
        return result

    def _account(
        self,
        obs: list[Any],
        reward_list: list[SupportsFloat],
        term_list: list[bool],
        trunc_list: list[bool],
        stepped_list: list[bool] | None,
        infos: dict[str, Any],
        finals: dict[int, Any],
        observations_out: np.ndarray | None = None,
        scores: dict[int, float] | None = None,
    ) -> StepResult:
        """Batch one step's per-env results and update the episode counters
        (`stepped_list` None: every env stepped)."""
        rewards = np.array(reward_list, dtype=np.float64)
        terminated = np.array(term_list, dtype=bool)
        truncated = np.array(trunc_list, dtype=bool)
        done = terminated | truncated
        self._ended = done
        self._returns += rewards
        if stepped_list is None:
            self.total_steps += self.num_envs
            self._lengths += 1
        else:
            stepped = np.array(stepped_list, dtype=bool)
            self.total_steps += int(stepped.sum())
            self._lengths += stepped
        episodes = []
        if done.any():
            for i in np.flatnonzero(done).tolist():
                ret, length = float(self._returns[i]), int(self._lengths[i])
                score = scores.get(i) if scores else None
                episodes.append(EpisodeStats(i, ret, length, bool(trunc_list[i]), score))
            self._returns[done] = 0.0
            self._lengths[done] = 0
        observations = _stack(self.observation_space, obs, out=observations_out)
        return StepResult(
            observations=self._finite(observations, "step"),
            rewards=rewards if self.float64_rewards else rewards.astype(np.float32),
            terminated=terminated,
            truncated=truncated,
            infos=infos,
            final_observations=self._finite(self._finals(finals), "step", "final_observations")
            if finals
            else None,
            episodes=episodes,
        )

    def _finite(self, obs: Any, request: str, field: str = "observations") -> Any:
        """The envs' observations with no NaN/inf, refused (naming env and field) or clipped."""
        return finite_observations(
            self.observation_space, obs, name=f"{request}.{field}", clip=self._clip_nonfinite
        )

    def _finals(self, finals: dict[int, Any]) -> Any:
        """The final observations of the envs in `finals`, zeros for the others."""
        space = self.observation_space
        if self._box_observations:  # the common case: only the few rows that ended are written
            shape = space.shape or ()
            out = np.zeros((self.num_envs, *shape), dtype=space.dtype)
            for i, row in finals.items():
                out[i] = row
            return out
        rows = [finals.get(i) for i in range(self.num_envs)]
        return _stack(space, rows, fill_missing=True)

    def render(self, indices: Sequence[int] = (), *, max_bytes: int | None = None) -> np.ndarray:
        """RGB frames uint8 [K, H, W, 3] of `indices` (default: env 0).

        With ``max_bytes``, ResourceExhausted as soon as the frames would exceed it: the first
        frame's size times K is the estimate, so at most one frame is rendered in vain.
        """
        if self.render_mode != "rgb_array":
            raise FailedPrecondition(
                f"render needs render_mode 'rgb_array' at create (have {self.render_mode!r})"
            )
        targets = self._targets(indices, "render.env_indices") or [0]
        frames: list[np.ndarray] = []
        total = 0
        for k, i in enumerate(targets):
            frame = np.asarray(self.envs[i].render(), dtype=np.uint8)
            total += frame.nbytes
            # What the whole answer comes to if the frames still to render are this size.
            estimate = total + frame.nbytes * (len(targets) - k - 1)
            if max_bytes is not None and estimate > max_bytes:
                raise ResourceExhausted(
                    f"{len(targets)} frames of shape {list(frame.shape)} come to about "
                    f"{estimate} bytes, over the {max_bytes} bytes a response may carry; "
                    "render fewer envs per request",
                    field="render.env_indices",
                )
            frames.append(frame)
        return np.stack(frames)

    def _targets(self, indices: Sequence[int], field: str) -> list[int]:
        return env_indices(indices, self.num_envs, field)

    def close(self) -> None:
        """Close every env; errors in one env's close do not keep the others open."""
        for env in self.envs:
            with contextlib.suppress(Exception):
                env.close()
        self.envs = []


def check_seeds(seed: int | None, seeds: Sequence[int | None] | None, resets: int) -> None:
    """A reset gives one base ``seed`` or one of ``seeds`` per env it resets, not both."""
    if seeds is None:
        return
    if seed is not None:
        raise InvalidArgument("set seed or seeds, not both", field="reset.seeds")
    if len(seeds) != resets:
        raise InvalidArgument(
            f"{len(seeds)} seeds for {resets} environments to reset (one each)",
            field="reset.seeds",
        )


def env_indices(indices: Sequence[int], n: int, field: str) -> list[int]:
    """``indices`` of a pool of ``n`` envs as a list after checking them: at most n, no
    duplicates, in range. The length is checked before anything is copied, so a huge request
    costs nothing."""
    if len(indices) > n:
        raise InvalidArgument(
            f"{len(indices)} env indices for a pool of {n} envs (each index at most once)",
            field=field,
        )
    targets = list(indices)
    if len(set(targets)) != len(targets):
        repeated = sorted(i for i, c in Counter(targets).items() if c > 1)
        raise InvalidArgument(f"env indices {repeated} repeated", field=field)
    bad = [i for i in targets if not 0 <= i < n]
    if bad:
        raise InvalidArgument(f"env indices {bad} out of range [0, {n})", field=field)
    return targets


def _unbatch(actions: Any, n: int) -> list[Any]:
    """Split a validated batch into N per-env actions, as SyncVectorEnv's `iterate` does."""
    if isinstance(actions, np.ndarray | list):
        return list(actions)  # numpy rows/scalars, or strings for Text
    if isinstance(actions, dict):
        columns = {k: _unbatch(v, n) for k, v in actions.items()}
        return [{k: col[i] for k, col in columns.items()} for i in range(n)]
    parts = [_unbatch(v, n) for v in actions]
    return [tuple(col[i] for col in parts) for i in range(n)]


def _stack(
    space: Any, rows: list[Any], *, fill_missing: bool = False, out: np.ndarray | None = None
) -> Any:
    """Batch N per-env observations like the space (fresh arrays; Text becomes a list of str).

    With fill_missing, None rows become zeros (final observations of envs that did not end).
    `out` (a Box space's batch only) receives the rows instead of a fresh array.
    """
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return {
            k: _stack(s, [None if r is None else r[k] for r in rows], fill_missing=fill_missing)
            for k, s in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        return tuple(
            _stack(s, [None if r is None else r[j] for r in rows], fill_missing=fill_missing)
            for j, s in enumerate(space.spaces)
        )
    if isinstance(space, spaces.Text):
        return ["" if r is None else str(r) for r in rows]
    if out is None:
        out = np.empty((len(rows), *space.shape), dtype=space.dtype)
    if fill_missing:
        out[:] = 0
        for i, row in enumerate(rows):
            if row is not None:
                out[i] = row
        return out
    shape = space.shape
    if shape and out.flags.c_contiguous and _shapes(rows) == {shape}:
        # The rows end to end: np.stack without its per-row expand_dims, which costs more than
        # the copy itself for small observations.
        np.concatenate(rows, out=out.reshape(-1, *shape[1:]), casting="unsafe")
        return out
    return np.stack(rows, out=out, casting="unsafe")


def _shapes(rows: list[Any]) -> set[tuple[int, ...]]:
    """The shapes of the rows, empty when one has none (a list, a scalar)."""
    try:
        return {row.shape for row in rows}
    except AttributeError:
        return set()


def _add_info(infos: dict[str, Any], info: dict[str, Any], i: int, n: int) -> None:
    """Merge env i's info into vector-style infos: key -> [N] array, "_key" -> [N] bool mask.

    Like gymnasium's VectorEnv._add_info, but numeric only (the wire carries tensors): strings
    and other objects are dropped.
    """
    for key, value in info.items():
        if isinstance(value, dict):
            sub = infos.get(key, {})
            _add_info(sub, value, i, n)
            infos[key] = sub
        else:
            array = infos.get(key)
            if array is None:
                if isinstance(value, bool | int | float | np.number | np.bool_):
                    array = np.zeros(n, dtype=np.asarray(value).dtype)
                elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
                    array = np.zeros((n, *value.shape), dtype=value.dtype)
                else:
                    continue
            array[i] = value
            infos[key] = array
        mask = infos.get(f"_{key}")
        if mask is None:
            mask = infos[f"_{key}"] = np.zeros(n, dtype=bool)
        mask[i] = True


def _score(info: dict[str, Any]) -> float | None:
    """info["score"] as a finite float; None when absent or not a finite real number (bools are
    not scores). Called only at an episode's end: the per-step path never looks."""
    value = info.get("score")
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        return None
    score = float(value)
    return score if np.isfinite(score) else None
