"""GameActor: the `game_actor` service kind's batched actor over remote environments.

One tick = one policy forward over all N envs + one concurrent step on every env server (or,
double-buffered, two half ticks whose env steps overlap the other half's forward: see
sampler/actors/sampling.py). Every `rollout_length` ticks the fragment goes to the run's
trajectory stream (when publishing), and in `learner` mode the newest fetched weight version
is swapped in. The actor ends when it has taken `total_steps` env steps (exit 0, the demo's
end), when the run's status says it is over, or on SIGTERM/SIGINT; it always closes its env
sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from typing import Any

from clients.learner import WeightFollower
from common.behaviour import Behaviour, RandomBehaviour, TorchBehaviour
from common.fragments import producer_id
from common.stats import ActorStats
from sampler.actors.envs import EnvGroup, TickEvents
from sampler.actors.rollout import FragmentMeta, Rollout
from sampler.actors.sampling import DoubleBuffer, fill_lock_step
from sampler.actors.settings import GameActorSettings
from services.bus import Bus, stop_when_run_over, stream_name, traj_subject
from services.errors import ConfigError
from services.membership import Members, PeerView
from services.placement import pin_to_assigned_cpus
from services.registry import ServiceContext
from services.waits import bus_say, waiting

__all__ = ["GameActor"]

log = logging.getLogger(__name__)


class GameActor:
    """One actor incarnation; `run()` returns when done or stopped."""

    def __init__(self, ctx: ServiceContext[GameActorSettings], settings: GameActorSettings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.stop = ctx.stop_event
        self.incarnation = uuid.uuid4().hex[:12]
        # Whose fragments these are, as the learner reports what it took (flow control, _pace).
        self.producer = producer_id(ctx.run_name, ctx.name, self.incarnation)
        self.bus: Bus | None = None
        self.members: Members | None = None
        self.envs = EnvGroup(
            PeerView(settings.env_servers, kind="env_server", resolve=ctx.resolve),
            settings.num_envs,
            settings.env_id,
            env_kwargs=settings.env_kwargs,
            seed=settings.env_seed(),
            request_timeout_s=settings.request_timeout_s,
            reconnect_timeout_s=settings.reconnect_timeout_s,
            stop_event=self.stop,
            colocated=settings.colocated,
            colocated_busy_poll_us=settings.colocated_busy_poll_us,
            colocated_block_us=settings.colocated_block_us,
            double_buffer=settings.double_buffer == "on",
            name=ctx.name,
        )
        self.follower: WeightFollower | None = None
        self._publishing: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._paced_base, self._paced_count = -1, 0  # see _pace_on_versions

    async def run(self) -> None:
        settings = self.settings
        if self.ctx.nats_url:
            self.bus = await Bus.connect(self.ctx.nats_url, name=f"{self.ctx.name}-actor")
        elif settings.publishes or settings.policy == "learner":
            raise ConfigError(f"game actor {self.ctx.name}: needs a NATS url (RLFLEET_NATS_URL)")
        try:
            await self._prepare_bus()
            await self._run()
        finally:
            await self._shutdown()

    async def _prepare_bus(self) -> None:
        bus, run = self.bus, self.ctx.run_name
        if bus is None:
            return
        if self.settings.publishes:
            await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        self._tasks.append(await stop_when_run_over(bus, run, self.stop))
        # Env servers named by instance are every live replica of it (services/membership.py).
        self.members = Members(bus, run)
        await self.members.start()
        self.envs.peers.follow(self.members)
        if self.settings.policy == "learner":
            address = self.ctx.resolve(self.settings.learner or "")
            self.follower = WeightFollower(bus, run, address)
            await self.follower.start()

    async def _make_policy(self) -> Behaviour | None:
        settings, envs = self.settings, self.envs
        seed = settings.env_seed()
        if settings.policy == "random":
            return RandomBehaviour(envs.action_space, envs.num_envs, seed)
        policy = TorchBehaviour(
            envs.observation_space,
            envs.action_space,
            settings.policy_config,
            device=settings.device,
            seed=seed,
        )
        assert self.follower is not None
        first = await waiting(
            f"the first weights from {self.follower.address}",
            self.follower.first(self.stop, settings.weights_timeout_s),
            say=bus_say(self.bus, self.ctx.run_name, self.ctx.name),
        )
        if first is None:
            return None
        policy.load(first[1], first[0])
        log.info("loaded weights v%d", first[0])
        return policy

    async def _run(self) -> None:
        settings, envs, ctx = self.settings, self.envs, self.ctx
        obs = await envs.open()
        if obs is None:
            return
        policy = await self._make_policy()
        if policy is None:
            return
        pin_to_assigned_cpus()  # started up (imports, sessions, weights): onto its CPUs, if any
        rollout = Rollout(
            settings.rollout_length,
            envs.num_envs,
            envs.observation_space,
            envs.action_space,
            has_values=policy.has_values,
            parts=envs.parts,
        )
        rollout.begin(obs)
        stats = ActorStats(
            self.bus, ctx.run_name, ctx.name, settings.env_id, settings.stats_interval_s
        )
        meta = FragmentMeta(
            ctx.run_name, ctx.name, self.incarnation, settings.env_id, envs.addresses, ""
        )
        log.info(
            "actor %s: %d x %s over %s (steps via %s)%s, policy %s, T=%d, fragments %s",
            ctx.name,
            envs.num_envs,
            settings.env_id,
            envs.addresses,
            envs.transports,
            ", double-buffered" if len(envs.parts) > 1 else "",
            settings.policy,
            settings.rollout_length,
            "on" if settings.publishes else "off",
        )
        total, stop = settings.total_steps, self.stop

        async def account(events: TickEvents, steps: int) -> bool:
            stats.steps += steps
            if events.episodes:
                await stats.episodes_ended(events.episodes, policy.version)
            if time.monotonic() >= stats.next_report:
                await stats.report(policy.version)
            return stop.is_set() or bool(total and stats.steps >= total)

        if len(envs.parts) > 1:
            fill = DoubleBuffer(self._part_policies(policy), rollout, envs).fill
        else:
            fill = functools.partial(fill_lock_step, policy, rollout, envs)
        while not stop.is_set():
            await fill(account)
            if rollout.full:
                if settings.publishes:
                    # The servers now: membership changes move envs between fragments.
                    meta = dataclasses.replace(
                        meta, env_address=envs.addresses, env_session_id=envs.session_ids
                    )
                    await self._publish(rollout.build(policy, meta))
                rollout.restart()
                await self._pace(policy, rollout.sequence)
                self._swap_weights(policy)
            if total and stats.steps >= total:
                break
        await stats.report(policy.version)
        log.info(
            "actor %s done: %d env steps in %.1fs (%.0f steps/s, via %s), %d episodes%s",
            ctx.name,
            stats.steps,
            time.monotonic() - stats.started,
            stats.mean_sps(),
            envs.transports,
            stats.episodes,
            f", {rollout.sequence} fragments" if settings.publishes else "",
        )

    def _part_policies(self, policy: Behaviour) -> list[Behaviour]:
        """Who acts for each part: the policy, or a random one drawing for the part's size."""
        if not isinstance(policy, RandomBehaviour):
            return [policy for _ in self.envs.parts]
        seed, space = self.settings.env_seed(), self.envs.action_space
        return [RandomBehaviour(space, p.stop - p.start, seed + p.start) for p in self.envs.parts]

    async def _pace(self, policy: Behaviour, built: int) -> None:
        """Flow control (learner mode): keep at most `fragments_per_version * (versions_ahead +
        1)` of this actor's fragments outstanding, i.e. built but not yet taken by the learner
        (WeightsPublished.taken_sequences, learner.consumer.TakenSequences). The actor thus
        collects `versions_ahead` updates ahead (overlapping the learner's training; 1 for PPO,
        the staleness bound for APPO) but never more: an actor that outruns the learner only
        makes fragments the learner drops as too stale. `built` is how many fragments this
        incarnation has built so far.

        Until the learner has announced taking any of them (start-up, a learner restart) the
        credit is counted in versions instead (`_pace_on_versions`)."""
        per_version = self.settings.fragments_per_version
        if not per_version or self.follower is None:
            return
        follower = self.follower
        if follower.taken(self.producer) is None:
            await self._pace_on_versions(policy, per_version)
            return
        self._paced_base, self._paced_count = -1, 0  # a fresh count if it is needed again
        limit = per_version * (self.settings.versions_ahead + 1)
        deadline = time.monotonic() + self.settings.version_wait_s
        while not self.stop.is_set():
            taken = follower.taken(self.producer)
            if taken is None or built - (taken + 1) < limit:
                return
            left = deadline - time.monotonic()
            if left <= 0 or not await follower.wait_newer(follower.version, self.stop, left):
                if not self.stop.is_set():
                    log.warning(
                        "%d fragments outstanding and no new version for %.0fs: going on",
                        built - (taken + 1),
                        self.settings.version_wait_s,
                    )
                return

    async def _pace_on_versions(self, policy: Behaviour, per_version: int) -> None:
        """The credit before the learner reports what it took: after `k` fragments since the
        count began (at version `base`), wait for version
        `base + ceil(k / fragments_per_version) - versions_ahead`."""
        assert self.follower is not None
        if self._paced_base < 0:
            self._paced_base = policy.version
        self._paced_count += 1
        ahead = self.settings.versions_ahead
        wanted = self._paced_base + -(-self._paced_count // per_version) - ahead
        if self.follower.version >= wanted:
            return
        waited = time.monotonic()
        fresh = await self.follower.wait_newer(wanted - 1, self.stop, self.settings.version_wait_s)
        if not fresh and not self.stop.is_set():
            # The learner is slower than the credit assumes (an actor fewer, a restart):
            # start counting again from the version at hand rather than wait every time.
            log.warning(
                "no weights v%d after %.0fs: pacing restarts from v%d",
                wanted,
                time.monotonic() - waited,
                self.follower.version,
            )
            self._paced_base, self._paced_count = self.follower.version, 0

    def _swap_weights(self, policy: Behaviour) -> None:
        pending = self.follower.take() if self.follower is not None else None
        if pending is not None and isinstance(policy, TorchBehaviour):
            policy.load(pending[1], pending[0])
            log.info("swapped to weights v%d", pending[0])

    async def _publish(self, fragment: Any) -> None:
        """Send the fragment in the background; wait for the previous one first (one in flight
        keeps order and bounds memory)."""
        if self._publishing is not None:
            await self._publishing
        self._publishing = asyncio.create_task(self._send(fragment))
        # Let it start now: steps answered without the event loop (colocated_block_us) would
        # run it only at their next yield.
        await asyncio.sleep(0)

    async def _send(self, fragment: Any) -> None:
        assert self.bus is not None
        await self.bus.publish_with_retry(
            traj_subject(self.ctx.run_name),
            fragment,
            msg_id=fragment.fragment_id,
        )

    async def _shutdown(self) -> None:
        """Finish the fragment in flight, close sessions, the weight follower and the bus."""
        try:
            if self._publishing is not None:
                await self._publishing
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.envs.close()
            if self.members is not None:
                await self.members.close()
            if self.follower is not None:
                await self.follower.close()
            if self.bus is not None:
                with contextlib.suppress(Exception):
                    await self.bus.close()
