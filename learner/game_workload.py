"""The game-RL workload of the learner loop (learner.loop): rollout fragments in, PPO/A2C updates
(learner.game) of a ``common.policies`` policy on a DeepSpeed engine, ``final/policy.pt`` out.

What is particular to it: the env spaces (from an env server, or a local env), the learning-rate
schedule over env steps, the episode statistics actors publish (``charts/episodic_return``, and
``target_return`` ending the run early), and the ``rlfleet play`` layout of ``final/``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.artifacts import save_policy
from common.policies import build_policy
from learner.algos import constant, linear_anneal
from learner.engine import Engine, build_engine
from learner.game import Fragment, FragmentBatch, decode_fragment, update
from learner.loop import LearnerLoop
from learner.settings import LearnerSettings
from learner.workload import Envelope, Progress
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from services.bus import events_subject
from services.errors import InvalidArgument, RlfleetError
from services.registry import ServiceContext

__all__ = ["GameWorkload"]


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
        self.episodes = 0
        self._steps_this_run = 0  # env steps since this incarnation began consuming: SPS
        self._watcher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ set-up and state

    async def setup(self) -> None:
        s = self.settings
        if not s.env_servers:
            self.spaces = await asyncio.to_thread(_local_spaces, s.env_id, s.env_kwargs)
        else:
            addresses = [self.ctx.resolve(name) for name in s.env_servers]
            self.spaces = await _remote_spaces(
                addresses, s.env_id, s.env_kwargs, s.spaces_timeout_s
            )

    def build(self) -> Engine:
        assert self.spaces is not None
        s = self.settings
        policy = build_policy(self.spaces[0], self.spaces[1], s.policy)
        policy.forward = policy.evaluate  # type: ignore[method-assign]  # DeepSpeed calls forward
        self.engine = build_engine(policy, s.optimizer(), s.deepspeed())
        return self.engine

    def restore(self, state: dict[str, Any]) -> None:
        self.returns.extend(state.get("returns", ()))
        self.lengths.extend(state.get("lengths", ()))
        self.episodes = int(state.get("episodes", 0))

    def state(self) -> dict[str, Any]:
        return {
            "returns": list(self.returns),
            "lengths": list(self.lengths),
            "episodes": self.episodes,
        }

    def warm_start(self, run: LearnerLoop) -> None:
        """Nothing: game RL starts from the freshly initialised policy."""

    def weights(self) -> dict[str, torch.Tensor]:
        assert self.engine is not None
        return self.engine.named_weights()

    async def begin(self, run: LearnerLoop) -> None:
        """Follow the episode statistics actors publish."""
        assert run.bus is not None
        episodes = await run.bus.subscribe(
            events_subject(self.ctx.run_name, "episodes"), events_pb2.EpisodeStats
        )
        self._watcher = asyncio.create_task(self._watch_episodes(episodes), name="episodes")

    async def _watch_episodes(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                episode = delivery.message
                self.returns.append(float(episode.episode_return))
                self.lengths.append(float(episode.length))
                self.episodes += 1

    # ------------------------------------------------------------------ messages

    def envelope(self, message: Any) -> Envelope:
        steps = int(message.num_steps) * int(message.num_envs)
        return Envelope(message.fragment_id, int(message.policy_version), {"steps": steps})

    def decode(self, message: Any) -> Fragment:
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
        metrics = update(self.engine, batch, self.settings, lr=lr, generator=generator)
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
        return out

    def step(self, progress: Progress) -> int:
        return progress.samples  # CleanRL's global_step: env steps

    async def after_update(self, run: LearnerLoop) -> None:
        """Nothing: no periodic work besides the loop's checkpoints."""

    # ------------------------------------------------------------------ the end

    def done(self, progress: Progress) -> bool:
        """The step budget is spent, or the mean return of the last `episode_window` episodes
        has reached `target_return` (when set)."""
        s = self.settings
        if progress.samples >= s.total_timesteps:
            return True
        full = len(self.returns) >= s.episode_window
        target = s.target_return
        return target is not None and full and float(np.mean(self.returns)) >= target

    async def finish(self, run: LearnerLoop) -> None:
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
        assert self.engine is not None and self.spaces is not None
        s = self.settings
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
        )

    def summary(self, progress: Progress) -> str:
        return f"{progress.samples} env steps in {progress.updates} updates"

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)


def _local_spaces(env_id: str, env_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    import gymnasium

    env = gymnasium.make(env_id, **env_kwargs)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


async def _remote_spaces(
    addresses: list[str], env_id: str, env_kwargs: dict[str, Any], timeout_s: float
) -> tuple[Any, Any]:
    """The spaces an env server reports for ``env_id`` (a one-env session, closed at once);
    tries each address in turn until ``timeout_s``."""
    from google.protobuf import struct_pb2

    from common import spaces as space_codec
    from rlfleet.env.v1 import env_pb2, env_pb2_grpc
    from services.errors import from_status
    from services.server import channel

    kwargs = struct_pb2.Struct()
    kwargs.update(env_kwargs)
    create = env_pb2.SessionRequest(
        request_id=1, create=env_pb2.CreateRequest(env_id=env_id, num_envs=1, kwargs=kwargs)
    )
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for address in addresses:
            try:
                async with channel(address) as ch:
                    call = env_pb2_grpc.EnvServiceStub(ch).Session(iter([create]), timeout=30.0)
                    async for response in call:
                        if response.HasField("error"):
                            raise from_status(response.error)
                        info = response.create
                        return (
                            space_codec.from_proto(info.observation_space),
                            space_codec.from_proto(info.action_space),
                        )
            except RlfleetError:
                raise
            except Exception as exc:  # not up yet: try the next one, then again
                last = exc
        await asyncio.sleep(1.0)
    raise TimeoutError(f"no env server of {addresses} answered within {timeout_s:g}s: {last}")
