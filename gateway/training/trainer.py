"""The bus side of the gateway's training mode: tasks from the run's prompt work queue (paced by
the learner's versions, as rollout drivers are), finished groups of agent sessions to the
learner (Nats-Msg-Id = the task's group id, then the task acked), sessions past their deadline
dropped, and the mode's numbers as Metrics events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from google.protobuf import timestamp_pb2

from clients.trajectories.groups import episode_group, group_id
from clients.trajectories.pacing import Pacer
from clients.trajectories.prompts import PromptFeeder, PromptQueue, prompt_key
from gateway.settings import AgentTraining
from gateway.training.sessions import AgentSession, SessionBook, SessionLimits, TaskGroup
from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject, stream_name, traj_subject
from services.errors import InvalidArgument, Unavailable

if TYPE_CHECKING:
    from gateway.app import Gateway

__all__ = ["AgentTrainer", "start_training"]

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 1.0  # how often sessions past their deadline are looked for
REWARD_NAME = "agent"  # the reward's function name in the groups: the agent's own


class AgentTrainer:
    """Sessions of agents (`book`) fed with tasks and drained to the learner."""

    def __init__(
        self,
        bus: Bus,
        run: str,
        source: str,
        settings: AgentTraining,
        stop: asyncio.Event,
        sampler_version: Any,
    ) -> None:
        self.bus, self.run, self.source, self.settings = bus, run, source, settings
        self.stop = stop
        self.pacer = Pacer.following(settings, sampler_version)
        self.watch = self.pacer.watch
        self.queue = PromptQueue(
            bus, run, settings.queue, ack_wait_s=settings.prompt_ack_wait_s, prefetch=1
        )
        limits = SessionLimits(
            session_timeout_s=settings.session_timeout_s,
            max_calls=settings.max_calls_per_session,
            max_tokens=settings.max_session_tokens,
        )
        self.book = SessionBook(settings.group_size, limits, self._take, self._publish)
        self.published = 0
        self._rewards: list[float] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, version: int) -> None:
        await self.watch.observe(version)
        await self.bus.ensure_stream(stream_name(self.run), [traj_subject(self.run)])
        await self.watch.start(self.bus, self.run)
        if self.settings.groups_per_version:
            await self.pacer.follow_drops(self.bus, self.run, self.source)
        self._tasks = [
            asyncio.create_task(self._sweep(), name="agent-sessions-sweep"),
            asyncio.create_task(self._report(), name="agent-sessions-report"),
        ]
        if self.settings.dataset is not None:
            feeder = PromptFeeder(
                self.bus,
                self.run,
                self.settings.queue,
                self.settings.dataset,
                depth=self.settings.queue_depth,
            )
            self._tasks.append(asyncio.create_task(feeder.run_until(self.stop), name="feeder"))
        await self.queue.start()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.queue.close()
        await self.pacer.close()
        await self.watch.close()

    async def _take(self) -> Any:
        """The next task, once pacing lets a group start (Unavailable: none in time)."""
        deadline = time.monotonic() + self.settings.task_wait_s
        if not await self.pacer.wait_turn(self.stop):
            raise Unavailable("the gateway is stopping")
        left = max(deadline - time.monotonic(), 0.001)
        taken = await self.queue.take(1, self.stop, first_timeout_s=left)
        if not taken:
            raise Unavailable(
                f"no task within {self.settings.task_wait_s:g}s (the prompt queue is empty or "
                "the learner is behind): retry"
            )
        (delivery,) = taken
        self.pacer.count(1, [group_id(self.run, delivery.message)])
        return delivery

    async def _publish(self, group: TaskGroup, rewarded: list[AgentSession]) -> None:
        """A settled group to the learner (exactly once, by its id), then its task acked."""
        task, delivery = group.task, group.delivery
        if rewarded:
            episodes = [s.episode for s in rewarded if s.episode is not None]
            try:
                out = episode_group(self.run, self.source, task, episodes, reward_name=REWARD_NAME)
                await self.bus.publish_with_retry(traj_subject(self.run), out, msg_id=out.group_id)
            except InvalidArgument as exc:  # too large for the bus, openings with nothing shared
                log.error("dropping task %s: its group %s", prompt_key(task), exc)
                self.pacer.credit([group_id(self.run, task)])
            else:
                self.published += 1
                self._rewards += [s.reward for s in rewarded if s.reward is not None]
        else:
            self.pacer.credit([group_id(self.run, task)])  # no group will come
        await self.queue.ack([delivery])

    async def _sweep(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), SWEEP_EVERY_S)
            try:
                await self.book.sweep()
            except Exception:
                log.exception("dropping timed-out sessions failed")

    async def _report(self) -> None:
        subject = events_subject(self.run, "metrics")
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.settings.metrics_interval_s)
            scalars = self.scalars()
            stamp = timestamp_pb2.Timestamp()
            stamp.GetCurrentTime()
            with contextlib.suppress(Exception):  # a metrics event is never worth failing for
                await self.bus.publish_event(
                    subject,
                    events_pb2.Metrics(
                        run=self.run,
                        source=self.source,
                        step=self.book.counts["started"],
                        time=stamp,
                        scalars=scalars,
                        policy_version=self.watch.version,
                    ),
                )

    def scalars(self) -> dict[str, float]:
        """The interval's numbers (`agent/...`); the reward mean is over its groups."""
        book = self.book
        out = {
            "agent/sessions_started": float(book.counts["started"]),
            "agent/sessions_rewarded": float(book.counts["rewarded"]),
            "agent/sessions_open": float(len(book.sessions)),
            "agent/groups_published": float(self.published),
            "agent/groups_empty": float(book.empty_groups),
            "agent/history_restarts": float(book.counts["restarts"]),
        }
        for why, count in book.dropped.items():
            out[f"agent/sessions_dropped_{why}"] = float(count)
        for cap, count in book.capped.items():
            out[f"agent/sessions_capped_{cap}"] = float(count)
        if self._rewards:
            out["agent/reward_mean"] = sum(self._rewards) / len(self._rewards)
            self._rewards = []
        return out


async def start_training(
    gateway: Gateway, bus: Bus, run: str, source: str, stop: asyncio.Event
) -> AgentTrainer:
    """An AgentTrainer for ``gateway`` (its settings.training), started from the version its
    samplers serve."""
    settings = gateway.settings.training
    assert settings is not None

    async def sampler_version() -> int:
        """The lowest version the healthy samplers serve (pacing waits for it)."""
        infos = [await b.replica.info() for b in gateway.pool.healthy_backends()]
        return min((int(i.policy_version) for i in infos), default=0)

    trainer = AgentTrainer(bus, run, source, settings, stop, sampler_version)
    await trainer.start(await sampler_version())
    log.info(
        "%s: training mode, %d sessions per task from queue %s",
        source,
        settings.group_size,
        settings.queue,
    )
    return trainer
