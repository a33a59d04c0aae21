"""The `learner` service kind (game RL): fragments in from JetStream, PPO/A2C updates on a
DeepSpeed engine, weight versions out through WeightService and the bus.

Delivery guarantees (DESIGN.md, "at-least-once delivery plus idempotent consumers"):

- a fragment is acked only after a checkpoint that includes its update is on disk; the
  checkpoint stores the ids of applied fragments, so after a crash the unacked fragments come
  back and those already in the restored weights are skipped, the others applied once;
- stale fragments (lag > max_policy_lag) and malformed ones are dropped, counted, written to the
  ledger and acked (terminated) at once: they will never be applied;
- ``<run_dir>/learner/applied.jsonl`` is the ledger of every fragment applied (and dropped); on
  a restart its "applied" lines past the restored checkpoint are removed, so at any time it says
  exactly which fragments the weights contain;
- versions never repeat: ``<run_dir>/learner/state.json`` remembers the last one published, and a
  restarted learner continues after it (actors holding a newer version than the checkpoint's
  would otherwise ignore the repeated numbers).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from google.protobuf import timestamp_pb2

from common.policies import build_policy
from env_server.play import save_policy
from learner.algos import constant, linear_anneal
from learner.consumer import (
    Ledger,
    TrajectoryConsumer,
    next_version,
    now,
    publish_version,
    rng_state,
    set_rng_state,
    settle,
)
from learner.engine import Engine, build_engine
from learner.game import AppliedWindow, Fragment, FragmentBatch, decode_fragment, triage, update
from learner.settings import LearnerSettings
from learner.weights import SERVICE_NAME as WEIGHTS_SERVICE
from learner.weights import WeightServicer, WeightStore, add_weight_service
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from rlfleet.learner.v1 import learner_pb2, learner_pb2_grpc
from services.bus import Bus, events_subject, stream_name, traj_subject
from services.errors import InvalidArgument, RlfleetError
from services.registry import ServiceContext, ServiceSpec
from services.server import GrpcServer

__all__ = ["SPEC", "GameLearner", "main"]

log = logging.getLogger(__name__)

LEARNER_SERVICE = "rlfleet.learner.v1.LearnerService"
DURABLE = "learner"


@dataclass
class Progress:
    """Counters and windows carried across restarts in every checkpoint's client state."""

    updates: int = 0
    version: int = 0  # latest published policy version
    global_step: int = 0  # env transitions applied
    messages: int = 0  # fragments applied
    stale_dropped: int = 0
    duplicates_dropped: int = 0
    invalid_dropped: int = 0
    applied: AppliedWindow = field(default_factory=lambda: AppliedWindow(100_000))
    returns: collections.deque[float] = field(default_factory=collections.deque)
    lengths: collections.deque[float] = field(default_factory=collections.deque)
    episodes: int = 0

    def to_state(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in _COUNTERS}
        state.update(applied=self.applied.to_list(), applied_max=self.applied.maxlen)
        state.update(returns=list(self.returns), lengths=list(self.lengths))
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], window: int, episodes: int) -> Progress:
        progress = cls(**{k: int(state.get(k, 0)) for k in _COUNTERS})
        progress.applied = AppliedWindow(window, state.get("applied", ()))
        progress.returns = collections.deque(state.get("returns", ()), maxlen=episodes)
        progress.lengths = collections.deque(state.get("lengths", ()), maxlen=episodes)
        return progress


_COUNTERS = (
    "updates",
    "version",
    "global_step",
    "messages",
    "stale_dropped",
    "duplicates_dropped",
    "invalid_dropped",
    "episodes",
)


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """GetStatus over a running GameLearner."""

    def __init__(self, learner: GameLearner) -> None:
        self.learner = learner

    async def GetStatus(
        self, request: learner_pb2.GetStatusRequest, context: Any
    ) -> learner_pb2.GetStatusResponse:
        return self.learner.status()


class GameLearner:
    """One learner incarnation; ``run()`` returns when the run is done or the service stopped."""

    def __init__(self, ctx: ServiceContext, settings: LearnerSettings) -> None:
        self.ctx, self.settings = ctx, settings
        self.run_name = ctx.run_name
        self.dirs = {
            "checkpoints": ctx.run_dir / "checkpoints",
            "learner": ctx.run_dir / "learner",
            "final": ctx.run_dir / "final",
            "tensorboard": ctx.run_dir / "tensorboard",
        }
        self.progress = Progress(applied=AppliedWindow(settings.applied_window))
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.ledger = Ledger(self.dirs["learner"] / "applied.jsonl")
        self.engine: Engine | None = None
        self.store: WeightStore | None = None
        self.bus: Bus | None = None
        self.server: GrpcServer | None = None
        self.writer: Any = None
        self.metrics: dict[str, float] = {}
        self.last_update_time: timestamp_pb2.Timestamp | None = None
        self.obs_shape: tuple[int, ...] = ()
        self.action_shape: tuple[int, ...] = ()
        self.consumer: TrajectoryConsumer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._checkpointed_updates = 0
        self._started = time.monotonic()
        self._steps_this_run = 0
        self.spaces: tuple[Any, Any] | None = None

    # ------------------------------------------------------------------ set-up

    async def _spaces(self) -> tuple[Any, Any]:
        s = self.settings
        if not s.env_servers:
            return await asyncio.to_thread(_local_spaces, s.env_id, s.env_kwargs)
        addresses = [self.ctx.resolve(name) for name in s.env_servers]
        return await _remote_spaces(addresses, s.env_id, s.env_kwargs, s.spaces_timeout_s)

    def _build(self, spaces: tuple[Any, Any]) -> None:
        """Policy and engine (blocking: run in a thread); restores the latest checkpoint."""
        s = self.settings
        random.seed(s.seed)
        np.random.seed(s.seed)
        torch.manual_seed(s.seed)
        policy = build_policy(spaces[0], spaces[1], s.policy)
        policy.forward = policy.evaluate  # type: ignore[method-assign]  # DeepSpeed calls forward
        self.engine = build_engine(policy, s.optimizer(), s.deepspeed())
        state = self.engine.load(self.dirs["checkpoints"])
        if state is not None:
            self.progress = Progress.from_state(state, s.applied_window, s.episode_window)
            set_rng_state(self.generator, state["rng"])
            self._checkpointed_updates = self.progress.updates
        counts = self.ledger.restore(self.progress.updates)
        self.progress.stale_dropped = counts.get("stale", 0)
        self.progress.invalid_dropped = counts.get("invalid", 0)
        self.progress.returns = collections.deque(self.progress.returns, maxlen=s.episode_window)
        self.progress.lengths = collections.deque(self.progress.lengths, maxlen=s.episode_window)
        log.info(
            "learner %s at update %d, version %d, %d env steps (%s)",
            self.ctx.name,
            self.progress.updates,
            self.progress.version,
            self.progress.global_step,
            "restored" if state is not None else "fresh",
        )

    async def _publish_weights(self) -> None:
        assert self.engine is not None and self.store is not None and self.bus is not None
        assert self.server is not None
        named = await asyncio.to_thread(self.engine.named_weights)
        self.progress.version = await publish_version(
            self.store, self.bus, self.run_name, named, self.dirs["learner"], self.server.address
        )

    # ------------------------------------------------------------------ the run

    async def run(self) -> None:
        s, ctx = self.settings, self.ctx
        self.dirs["learner"].mkdir(parents=True, exist_ok=True)
        self.server = GrpcServer(ctx.name, host=ctx.host, port=ctx.port)
        try:
            self.spaces = await self._spaces()
            self.obs_shape = tuple(self.spaces[0].shape)
            self.action_shape = tuple(self.spaces[1].shape or ())
            await asyncio.to_thread(self._build, self.spaces)
            self.store = WeightStore(
                self.run_name,
                keep=s.keep_versions,
                start_version=next_version(
                    self.dirs["learner"], self.progress.updates, self.progress.version
                ),
            )
            self.server.add_service(add_weight_service, WeightServicer(self.store), WEIGHTS_SERVICE)
            self.server.add_service(
                learner_pb2_grpc.add_LearnerServiceServicer_to_server,
                LearnerServicer(self),
                LEARNER_SERVICE,
            )
            await self.server.start()
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dirs["tensorboard"]))
            if ctx.nats_url is None:
                raise InvalidArgument("the learner needs the bus: no NATS url given")
            self.bus = await Bus.connect(ctx.nats_url, name=ctx.name)
            await self.bus.ensure_stream(stream_name(self.run_name), [traj_subject(self.run_name)])
            await self._publish_weights()
            self.server.set_serving()
            log.info(
                "learner serving on %s, version %d", self.server.address, self.progress.version
            )
            await self._start_tasks()
            await self._loop()
        finally:
            await self._shutdown()

    async def _start_tasks(self) -> None:
        assert self.bus is not None
        s = self.settings
        episodes = await self.bus.subscribe(
            events_subject(self.run_name, "episodes"), events_pb2.EpisodeStats
        )
        self.consumer = TrajectoryConsumer(
            self.bus,
            stream=stream_name(self.run_name),
            durable=DURABLE,
            subject=traj_subject(self.run_name),
            message_type=trajectory_pb2.RolloutFragment,
            batch=s.fragments_per_update,
            ack_wait_s=s.ack_wait_s,
            max_ack_pending=s.max_ack_pending,
            stop_event=self.ctx.stop_event,
            on_invalid=self._on_invalid,
        )
        self.consumer.start()
        self._tasks = [asyncio.create_task(self._watch_episodes(episodes), name="episodes")]
        self._started = time.monotonic()

    def _on_invalid(self, exc: InvalidArgument) -> None:
        self.progress.invalid_dropped += 1
        self.ledger.write(id=None, status="invalid", error=str(exc))
        log.warning("dropped a malformed message: %s", exc)

    def _done(self) -> bool:
        """The step budget is spent, or the mean return of the last `episode_window` episodes
        has reached `target_return` (when set)."""
        s, p = self.settings, self.progress
        if p.global_step >= s.total_timesteps:
            return True
        full = len(p.returns) >= s.episode_window
        return s.target_return is not None and full and float(np.mean(p.returns)) >= s.target_return

    async def _loop(self) -> None:
        s, stop = self.settings, self.ctx.stop_event
        while not self._done() and not stop.is_set():
            fragments = await self._gather()
            if fragments is None:
                break
            await self._train(fragments)
            if self._done():
                await self._finish()
                return
            if self.progress.updates - self._checkpointed_updates >= s.checkpoint_every:
                await self._checkpoint()
        if self._done():  # restarted after the end
            await self._finish()

    # ------------------------------------------------------------------ consuming

    async def _gather(self) -> list[Fragment] | None:
        """``fragments_per_update`` fresh fragments (their deliveries held in _gathering); drops
        stale, duplicate and malformed ones on the way. None when stopped."""
        s, p = self.settings, self.progress
        assert self.consumer is not None
        fragments: list[Fragment] = []
        ids: set[str] = set()
        while len(fragments) < s.fragments_per_update:
            delivery = await self.consumer.next()
            if delivery is None:
                return None
            msg = delivery.message
            verdict = triage(
                msg.fragment_id, msg.policy_version, p.version, s.max_policy_lag, p.applied, ids
            )
            if verdict == "duplicate":
                p.duplicates_dropped += 1
                self.consumer.hold(delivery)  # acked with the next checkpoint
                continue
            if verdict == "stale":
                p.stale_dropped += 1
                self._drop(msg, "stale")
                await settle(delivery.ack())
                continue
            try:
                if msg.env_id and msg.env_id != s.env_id:
                    raise InvalidArgument(f"env_id {msg.env_id!r} is not {s.env_id!r}")
                fragment = decode_fragment(msg, self.obs_shape, self.action_shape)
            except InvalidArgument as exc:
                p.invalid_dropped += 1
                self._drop(msg, "invalid", error=str(exc))
                log.warning("dropped fragment %s: %s", msg.fragment_id, exc)
                await settle(delivery.term())
                continue
            fragments.append(fragment)
            ids.add(msg.fragment_id)
            self.consumer.hold(delivery)
        return fragments

    def _drop(self, msg: Any, status: str, **extra: Any) -> None:
        self.ledger.write(
            id=msg.fragment_id,
            status=status,
            update=self.progress.updates,
            version=self.progress.version,
            policy_version=msg.policy_version,
            steps=int(msg.num_steps) * int(msg.num_envs),
            **extra,
        )

    # ------------------------------------------------------------------ training

    def _lr(self) -> float:
        s = self.settings
        schedule = linear_anneal if s.anneal_lr else constant
        return schedule(self.progress.global_step, s.total_timesteps, s.learning_rate)

    async def _train(self, fragments: list[Fragment]) -> None:
        assert self.engine is not None
        s, p = self.settings, self.progress
        batch = FragmentBatch(fragments)
        lags = [p.version - f.policy_version for f in fragments]
        started = time.perf_counter()
        metrics = await asyncio.to_thread(
            update, self.engine, batch, s, lr=self._lr(), generator=self.generator
        )
        train_s = time.perf_counter() - started
        p.updates += 1
        p.global_step += batch.env_steps
        p.messages += len(fragments)
        self._steps_this_run += batch.env_steps
        for f, lag in zip(fragments, lags, strict=True):
            p.applied.add(f.fragment_id)
            self.ledger.write(
                id=f.fragment_id,
                status="applied",
                update=p.updates,
                version=p.version,
                policy_version=f.policy_version,
                steps=f.size,
                lag=lag,
            )
        assert self.consumer is not None
        self.consumer.applied()
        await self._publish_weights()
        self.last_update_time = now()
        elapsed = max(time.monotonic() - self._started, 1e-9)
        metrics.update(
            {
                "charts/SPS": self._steps_this_run / elapsed,
                "charts/policy_lag": float(np.mean(lags)),
                "charts/dropped_fragments": float(p.stale_dropped),
                "charts/global_step": float(p.global_step),
                "charts/update_s": train_s,
            }
        )
        if p.returns:
            metrics["charts/episodic_return"] = float(np.mean(p.returns))
            metrics["charts/episodic_length"] = float(np.mean(p.lengths))
        await self._report(metrics)

    async def _report(self, metrics: dict[str, float]) -> None:
        p = self.progress
        self.metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if self.writer is not None:
            for key, value in self.metrics.items():
                self.writer.add_scalar(key, value, p.global_step)
        message = events_pb2.Metrics(
            run=self.run_name,
            source=self.ctx.name,
            step=p.updates,
            time=now(),
            scalars=self.metrics,
            policy_version=p.version,
        )
        assert self.bus is not None
        with contextlib.suppress(RlfleetError):
            await self.bus.publish_event(events_subject(self.run_name, "metrics"), message)
        log.info(
            "update %d v%d step %d: %s",
            p.updates,
            p.version,
            p.global_step,
            " ".join(f"{k}={v:.4g}" for k, v in sorted(self.metrics.items())),
        )

    async def _watch_episodes(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                episode = delivery.message
                self.progress.returns.append(float(episode.episode_return))
                self.progress.lengths.append(float(episode.length))
                self.progress.episodes += 1

    # ------------------------------------------------------------------ checkpoints and the end

    async def _checkpoint(self) -> None:
        """Save, then ack every fragment the checkpoint covers."""
        assert self.engine is not None
        p = self.progress
        state = {**p.to_state(), "rng": rng_state(self.generator)}
        await asyncio.to_thread(
            self.engine.save,
            self.dirs["checkpoints"],
            f"update-{p.updates:08d}",
            state,
            keep=self.settings.keep_checkpoints,
        )
        self._checkpointed_updates = p.updates
        acked = await self.consumer.ack_checkpointed() if self.consumer is not None else 0
        log.info("checkpoint at update %d (%d fragments acked)", p.updates, acked)

    async def _finish(self) -> None:
        """Final policy, last checkpoint, RunStatus DONE."""
        assert self.engine is not None and self.spaces is not None
        p = self.progress
        if self.writer is not None and p.returns:
            # Episodes that arrived after the last update's report (while it was published, or
            # during a checkpoint) can be what ended the run: record the return it ended on.
            self.writer.add_scalar(
                "charts/episodic_return", float(np.mean(p.returns)), p.global_step
            )
            self.writer.add_scalar(
                "charts/episodic_length", float(np.mean(p.lengths)), p.global_step
            )
        await asyncio.to_thread(self._save_final)
        await self._checkpoint()
        status = events_pb2.RunStatus(
            run=self.run_name,
            state=events_pb2.RUN_STATE_DONE,
            message=f"{self.progress.global_step} env steps in {self.progress.updates} updates",
            source=self.ctx.name,
            time=now(),
        )
        assert self.bus is not None
        await self.bus.publish_event(events_subject(self.run_name, "status"), status)
        log.info("done: %s", status.message)

    def _save_final(self) -> None:
        """``final/policy.pt`` + ``policy.json``, the layout `rlfleet play` loads."""
        assert self.engine is not None and self.spaces is not None
        s, p = self.settings, self.progress
        save_policy(
            self.dirs["final"],
            self.engine.named_weights(torch.float32),
            env_id=s.env_id,
            env_kwargs=s.env_kwargs,
            observation_space=self.spaces[0],
            action_space=self.spaces[1],
            policy=s.policy,
            algo=s.algo,
            version=p.version,
            global_step=p.global_step,
            updates=p.updates,
        )

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Stopped between checkpoints: save what was applied so its fragments can be acked.
        if self.engine is not None and self.progress.updates > self._checkpointed_updates:
            with contextlib.suppress(Exception):
                await self._checkpoint()
        if self.consumer is not None:  # what was not applied goes back to the stream at once
            await self.consumer.close()
        self.ledger.close()
        if self.writer is not None:
            self.writer.close()
        if self.bus is not None:
            await self.bus.close()
        if self.server is not None:
            await self.server.stop()
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------------ status

    def status(self) -> learner_pb2.GetStatusResponse:
        p, s = self.progress, self.settings
        response = learner_pb2.GetStatusResponse(
            run=self.run_name,
            policy_version=p.version,
            updates=p.updates,
            samples_consumed=p.global_step,
            messages_consumed=p.messages,
            stale_dropped=p.stale_dropped,
            duplicates_dropped=p.duplicates_dropped,
            invalid_dropped=p.invalid_dropped,
            max_policy_lag=s.max_policy_lag,
            metrics=self.metrics,
        )
        if self.last_update_time is not None:
            response.last_update_time.CopyFrom(self.last_update_time)
        return response


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


async def main(ctx: ServiceContext) -> None:
    """Train until total_timesteps env steps are consumed (exit 0) or the service is stopped."""
    settings: LearnerSettings = ctx.settings  # type: ignore[assignment]
    await GameLearner(ctx, settings).run()


SPEC = ServiceSpec(kind="learner", settings=LearnerSettings, main=main, grpc=True)
