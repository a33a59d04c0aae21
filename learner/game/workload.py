"""The game-RL workload of the learner loop (learner.loop): rollout fragments in, PPO/A2C updates
(learner.game) of a ``common.policies`` policy on a DeepSpeed engine, ``final/policy.pt`` out.

What is particular to it: the env spaces (from an env server, or a local env), the learning-rate
schedule over env steps, the episode statistics actors publish (``charts/episodic_return``, and
``target_return`` ending the run early), and the ``rlfleet play`` layout of ``final/``.

Every run leaves a playable policy: ``final/`` when it ends, and also when it is stopped
(SIGTERM/SIGINT) before its end, then marked ``"complete": false`` with ``stopped_at_update``;
every checkpoint carries the policy description (``common.artifacts.POLICY_STATE_KEY``), so
`load_policy` can read a run killed before either. A learner started on a run that is already
over says so at once (the run, why, and how to start afresh or continue) and only re-announces
the end.

The run's start, stop and end cases stay side by side in this one class, where they read best.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch

from clients.env import env_spaces
from common.artifacts import (
    CHECKPOINTS_DIR,
    MODEL_STATES_FILES,
    POLICY_STATE_KEY,
    policy_description,
    save_policy,
)
from common.fragments import producer_of
from common.policies import build_policy
from learner.algos import constant, linear_anneal
from learner.consumer import now
from learner.engine import Engine, build_engine
from learner.game.settings import LearnerSettings
from learner.game.update import Fragment, FragmentBatch, decode_fragment, update
from learner.settings import DeepSpeedSettings
from learner.workload import Envelope, Progress, RunHandle
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from services.bus import events_subject
from services.errors import InvalidArgument, RlfleetError, Unavailable
from services.registry import ServiceContext
from services.waits import waiting

__all__ = ["GameWorkload", "build_game_engine", "engine_settings"]

log = logging.getLogger(__name__)

SPACES_REQUEST_S = 30.0  # the most one env server may take to answer for its spaces

# The progress line `rlfleet up` shows (services.progress): (label, metric) in display order.
HEADLINE = (
    ("EpRewMean", "charts/episodic_return"),
    ("EpLenMean", "charts/episodic_length"),
    ("FPS", "charts/SPS"),
)


class GameWorkload:
    """PPO / A2C over RolloutFragments (see learner.workload.Workload for the protocol)."""

    durable = "learner"
    message_type = trajectory_pb2.RolloutFragment
    noun = "fragments"
    serve_before_first_version = False  # building a policy is quick: serve with version 0

    def __init__(self, ctx: ServiceContext[LearnerSettings], settings: LearnerSettings) -> None:
        self.ctx, self.settings = ctx, settings
        self.messages_per_update = settings.fragments_per_update
        self.engine: Engine | None = None
        self.spaces: tuple[Any, Any] | None = None  # (observation, action) of one env
        window = settings.episode_window
        self.returns: collections.deque[float] = collections.deque(maxlen=window)
        self.lengths: collections.deque[float] = collections.deque(maxlen=window)
        # Same window as the returns; None for episodes whose game reported no score.
        self.scores: collections.deque[float | None] = collections.deque(maxlen=window)
        self.episodes = 0
        self._steps_this_run = 0  # env steps since this incarnation began consuming: SPS
        self._watcher: asyncio.Task[None] | None = None
        self._run: RunHandle | None = None  # from begin: what a stop saves final/ from
        self._final_saved = False  # this incarnation wrote final/ (the run's end)
        self._over_at_start: str | None = None  # why the run was already over when it began
        self._description: dict[str, Any] | None = None  # the policy's, for every checkpoint
        self._resumed = False  # restored from a checkpoint: announced by begin

    # ------------------------------------------------------------------ set-up and state

    async def setup(self) -> None:
        # Before the engine is built (the slow part): a run that is already over says so now.
        state = await asyncio.to_thread(_checkpoint_state, self.ctx.run_dir / CHECKPOINTS_DIR)
        if state is not None:
            self._note_over(int(state.get("samples", 0)), state.get("returns") or ())
        s = self.settings
        if not s.env_servers:
            self.spaces = await asyncio.to_thread(_local_spaces, s.env_id, s.env_kwargs)
        else:
            addresses = [self.ctx.resolve(name) for name in s.env_servers]
            # Logged only (no bus yet): a game-link server says on the console that it waits
            # for its first game, which is what its spaces wait for.
            self.spaces = await waiting(
                f"the spaces of {s.env_id} from {', '.join(addresses)}",
                _remote_spaces(addresses, s.env_id, s.env_kwargs, s.spaces_timeout_s),
            )

    def build(self) -> Engine:
        assert self.spaces is not None
        s = self.settings
        policy = build_policy(self.spaces[0], self.spaces[1], s.policy)
        policy.forward = policy.evaluate  # type: ignore[method-assign]  # DeepSpeed calls forward
        self.engine = build_game_engine(policy, s)
        return self.engine

    def restore(self, state: dict[str, Any]) -> None:
        self.returns.extend(state.get("returns", ()))
        self.lengths.extend(state.get("lengths", ()))
        self.scores.extend(state.get("scores", ()))  # (absent in older checkpoints)
        self.episodes = int(state.get("episodes", 0))
        self._resumed = True

    def state(self) -> dict[str, Any]:
        return {
            "returns": list(self.returns),
            "lengths": list(self.lengths),
            "scores": list(self.scores),
            "episodes": self.episodes,
            POLICY_STATE_KEY: self._policy_description(),  # the checkpoint plays on its own
        }

    def _policy_description(self) -> dict[str, Any]:
        if self._description is None:
            assert self.spaces is not None
            s = self.settings
            self._description = policy_description(
                env_id=s.env_id,
                env_kwargs=s.env_kwargs,
                observation_space=self.spaces[0],
                action_space=self.spaces[1],
                policy=s.policy,
                algo=s.algo,
            )
        return self._description

    def warm_start(self, run: RunHandle) -> None:
        """Nothing: game RL starts from the freshly initialised policy."""

    def weights(self) -> dict[str, torch.Tensor]:
        assert self.engine is not None
        return self.engine.named_weights()

    async def begin(self, run: RunHandle) -> None:
        """Follow the episode statistics actors publish."""
        self._run = run
        if self._over_at_start is None:  # (setup could not read the checkpoint)
            self._note_over(run.progress.samples, self.returns)
        episodes = await run.bus.subscribe(
            events_subject(self.ctx.run_name, "episodes"), events_pb2.EpisodeStats
        )
        self._watcher = asyncio.create_task(self._watch_episodes(episodes), name="episodes")
        if self._resumed:
            p = run.progress
            status = events_pb2.RunStatus(
                run=self.ctx.run_name,
                state=events_pb2.RUN_STATE_RUNNING,
                message=f"resumed from checkpoint at update {p.updates} ({p.samples} env steps)",
                source=self.ctx.name,
                time=now(),
            )
            with contextlib.suppress(RlfleetError):  # the console's notice: best effort
                await run.bus.publish_event(events_subject(self.ctx.run_name, "status"), status)

    async def _watch_episodes(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                episode = delivery.message
                if episode.partial:
                    continue  # cut off by its producer: a part's return would skew the mean
                self.returns.append(float(episode.episode_return))
                self.lengths.append(float(episode.length))
                self.scores.append(float(episode.score) if episode.HasField("score") else None)
                self.episodes += 1

    # ------------------------------------------------------------------ messages

    def envelope(self, message: Any) -> Envelope:
        steps = int(message.num_steps) * int(message.num_envs)
        sequence = int(message.sequence)
        return Envelope(
            message.fragment_id,
            int(message.policy_version),
            {"steps": steps},
            producer=producer_of(message.fragment_id, sequence),
            sequence=sequence,
        )

    async def decode(self, message: Any) -> Fragment:
        assert self.spaces is not None
        s = self.settings
        if message.env_id and message.env_id != s.env_id:
            raise InvalidArgument(f"env_id {message.env_id!r} is not {s.env_id!r}")
        obs_shape = tuple(self.spaces[0].shape)
        action_shape = tuple(self.spaces[1].shape or ())
        return decode_fragment(message, obs_shape, action_shape)

    def accept(self, decoded: Fragment) -> tuple[list[Fragment], str | None]:
        return [decoded], None  # every well-formed fragment carries signal

    def samples(self, items: list[Fragment]) -> int:
        return sum(f.size for f in items)

    # ------------------------------------------------------------------ training

    def _lr(self, progress: Progress) -> float:
        s = self.settings
        schedule = linear_anneal if s.anneal_lr else constant
        return schedule(progress.samples, s.total_timesteps, s.learning_rate)

    def train(
        self, items: list[Fragment], progress: Progress, generator: torch.Generator
    ) -> dict[str, float]:
        assert self.engine is not None
        lags = [progress.version - f.policy_version for f in items]
        batch = FragmentBatch(items)
        lr = self._lr(progress)
        metrics = update(
            self.engine,
            batch,
            self.settings,
            lr=lr,
            generator=generator,
            clip_grad=_single_fp32_rank(self.settings),  # engine_settings: DeepSpeed does not
        )
        metrics["charts/policy_lag"] = float(np.mean(lags))
        return metrics

    def report(
        self, items: list[Fragment], metrics: dict[str, float], progress: Progress, elapsed_s: float
    ) -> dict[str, float]:
        self._steps_this_run += self.samples(items)
        out = {
            "charts/SPS": self._steps_this_run / elapsed_s,
            "charts/dropped_fragments": float(progress.stale_dropped),
            "charts/global_step": float(progress.samples),
        }
        if self.returns:
            out["charts/episodic_return"] = float(np.mean(self.returns))
            out["charts/episodic_length"] = float(np.mean(self.lengths))
            scores = [s for s in self.scores if s is not None]
            if scores:  # absent, not 0, when no episode of the window had a score
                out["charts/episodic_score"] = float(np.mean(scores))
        return out

    def step(self, progress: Progress) -> int:
        return progress.samples  # CleanRL's global_step: env steps

    async def after_update(self, run: RunHandle, metrics: Mapping[str, float]) -> None:
        """The progress record of `rlfleet up`'s progress line (env steps of total_timesteps)."""
        total = self.settings.total_timesteps
        await run.publish_progress("step", run.progress.samples, total, HEADLINE, metrics)

    # ------------------------------------------------------------------ the end

    def done(self, progress: Progress) -> bool:
        """The step budget is spent, or the mean return of the last `episode_window` episodes
        has reached `target_return` (when set)."""
        return self._end_reason(progress.samples, self.returns) is not None

    def _end_reason(self, samples: int, returns: Sequence[float]) -> str | None:
        s = self.settings
        if samples >= s.total_timesteps:
            return f"{samples} env steps reached total_timesteps {s.total_timesteps}"
        window = list(returns)[-s.episode_window :]
        target = s.target_return
        if target is None or len(window) < s.episode_window:
            return None
        mean = float(np.mean(window))
        if mean < target:
            return None
        return (
            f"the mean return of the last {s.episode_window} episodes, {mean:.4g}, reached "
            f"target_return {target:g}"
        )

    def _note_over(self, samples: int, returns: Sequence[float]) -> None:
        """Say, once, that the run was over before this learner began, and what to do."""
        reason = self._end_reason(samples, returns)
        if reason is None or self._over_at_start is not None:
            return
        knob = "total_timesteps" if "total_timesteps" in reason else "target_return"
        self._over_at_start = (
            f"run '{self.ctx.run_name}' is already finished ({reason}): nothing to train. "
            f"To start afresh: rm -r {self.ctx.run_dir} (or use a new run name); to continue "
            f"it: raise {knob} in the run config"
        )
        log.warning("%s", self._over_at_start)

    async def finish(self, run: RunHandle) -> None:
        # Episodes that arrived after the last update's report (while it was published, or
        # during a checkpoint) can be what ended the run: record the return it ended on.
        if self.returns:
            step = self.step(run.progress)
            run.write_scalars(
                {
                    "charts/episodic_return": float(np.mean(self.returns)),
                    "charts/episodic_length": float(np.mean(self.lengths)),
                },
                step,
            )

    def save_final(self, final_dir: Path, progress: Progress) -> None:
        """``final/policy.pt`` + ``policy.json``, the layout `rlfleet play` loads."""
        self._save(final_dir, progress, complete=True)
        self._final_saved = True

    def _save(self, final_dir: Path, progress: Progress, *, complete: bool) -> None:
        assert self.engine is not None and self.spaces is not None
        s = self.settings
        stopped = {} if complete else {"stopped_at_update": progress.updates}
        save_policy(
            final_dir,
            self.engine.named_weights(torch.float32),
            env_id=s.env_id,
            env_kwargs=s.env_kwargs,
            observation_space=self.spaces[0],
            action_space=self.spaces[1],
            policy=s.policy,
            algo=s.algo,
            version=progress.version,
            global_step=progress.samples,
            updates=progress.updates,
            complete=complete,
            **stopped,
        )

    def summary(self, progress: Progress) -> str:
        done = f"{progress.samples} env steps in {progress.updates} updates"
        if self._over_at_start:
            return f"{done}; {self._over_at_start}"
        reason = self._end_reason(progress.samples, self.returns)
        return f"{done}: {reason}" if reason else done

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await self._save_stopped()

    async def _save_stopped(self) -> None:
        """Stopped (SIGTERM/SIGINT) before the end: the current policy into ``final/``, marked
        incomplete, so the run can be played. Before the loop's stop checkpoint, which holds
        the same weights."""
        run = self._run
        if run is None or self._final_saved or self.engine is None:
            return
        p = run.progress
        if not self.ctx.stop_event.is_set() or p.updates == 0 or self.done(p):
            return
        final_dir = run.dirs.final
        try:
            await asyncio.to_thread(self._save, final_dir, p, complete=False)
        except Exception as exc:  # the stop checkpoint still follows
            log.warning("stopped at update %d; could not save %s: %s", p.updates, final_dir, exc)
            return
        log.info(
            "stopped at update %d (%d env steps): current policy saved to %s (complete: false)",
            p.updates,
            p.samples,
            final_dir,
        )


def build_game_engine(policy: torch.nn.Module, s: LearnerSettings) -> Engine:
    """The learner's engine: ``engine_settings`` with a fused AdamW (OptimizerSettings.fused),
    one kernel call per parameter for the whole step."""
    return build_engine(policy, s.optimizer(), engine_settings(s))


def _single_fp32_rank(s: LearnerSettings) -> bool:
    return s.ranks == 1 and s.zero_stage == 0 and s.precision == "fp32"


def engine_settings(s: LearnerSettings) -> DeepSpeedSettings:
    """The DeepSpeed settings of the learner's engine. One fp32 rank without ZeRO: no DeepSpeed
    gradient clipping, ``learner.game.update`` clips (``clip_grad_norm``: the same numbers,
    without DeepSpeed's all-reduce of the norm over a group of one, a large share of a small
    policy's step)."""
    ds = s.deepspeed()
    if _single_fp32_rank(s):
        ds = ds.model_copy(update={"gradient_clipping": None})
    return ds


def _checkpoint_state(checkpoints: Path) -> dict[str, Any] | None:
    """The client state of the latest checkpoint, read without an engine (None: none, or not
    readable; the engine's restore is what counts)."""
    try:
        tag = checkpoints / (checkpoints / "latest").read_text().strip()
        states = next(tag / n for n in MODEL_STATES_FILES if (tag / n).is_file())
        saved = torch.load(states, map_location="cpu", weights_only=True)
    except Exception:
        return None
    return saved if isinstance(saved, dict) else None


def _local_spaces(env_id: str, env_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    env = gymnasium.make(env_id, **env_kwargs)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


async def _remote_spaces(
    addresses: list[str], env_id: str, env_kwargs: dict[str, Any], timeout_s: float
) -> tuple[Any, Any]:
    """The spaces an env server reports for ``env_id``; tries each address in turn until
    ``timeout_s``, since env servers may start after the learner. A game-link env id is
    answered once a game has said Hello with it (UNAVAILABLE before: retried)."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for address in addresses:
            try:
                return await env_spaces(address, env_id, env_kwargs, timeout_s=SPACES_REQUEST_S)
            except Unavailable as exc:  # not up yet, or a game-link env id no game has linked
                last = exc
            except RlfleetError:
                raise
            except Exception as exc:  # not up yet: try the next one, then again
                last = exc
        await asyncio.sleep(1.0)
    raise TimeoutError(f"no env server of {addresses} answered within {timeout_s:g}s: {last}")
