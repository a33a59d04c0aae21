"""The rollout driver: prompts in, scored TrajectoryGroups out.

Each of `concurrency` workers loops: wait for pacing credit (clients/trajectories/pacing.py; the
learner gives credit back for groups it drops untrained), take up to `prompts_per_call` prompts
from the queue (clients/trajectories/prompts.py), Generate G completions of each on the next
sampler, Score every completion (plus an expert completion per prompt with
`expert_completions`), publish one TrajectoryGroup per prompt to `rlfleet.v1.traj.<run>` with
Nats-Msg-Id = group_id, then ack its prompt. Publishing before acking makes delivery
at-least-once; the deterministic group_id (clients/trajectories/groups.py) makes the repeat a
duplicate.

Errors: transient ones (UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED) are retried with
backoff; a sampler's INVALID_ARGUMENT about one prompt (too long for the context) drops that
prompt from the queue with an error in the log; any other error from a peer stops the driver
with the peer's message, and its prompts go back to the queue for the other drivers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from typing import Any

import numpy as np

from clients.env import SERVICE_NAME as ENV_SERVICE
from clients.env.episodes import ChatTokens, EpisodeLimits, play_group
from clients.env.text import TextSession
from clients.reward import SERVICE_NAME as REWARD_SERVICE
from clients.reward import RewardPool
from clients.sampler import SERVICE_NAME as SAMPLER_SERVICE
from clients.sampler import SamplerPool
from clients.trajectories.groups import episode_group, group_id
from clients.trajectories.pacing import Pacer
from clients.trajectories.prompts import PromptFeeder, PromptQueue, prompt_key, with_image_bytes
from common.datasets import ENV_SEED_KEY
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from sampler.rollout.groups import (
    Expert,
    build_groups,
    expert_text,
    generate_request,
    sampling_params,
    score_request,
    transcript_score_request,
)
from sampler.rollout.settings import RolloutSettings
from sampler.rollout.stats import RolloutStats
from sampler.rollout.turns import sampler_turns
from services.bus import Bus, Delivery, stop_when_run_over, stream_name, traj_subject
from services.bus.images import ImageStore
from services.calls import call_with_retry, wait_healthy
from services.errors import ConfigError, InvalidArgument, Unavailable
from services.membership import Balancer, Members, PeerView
from services.registry import ServiceContext
from services.waits import bus_say, waiting

__all__ = ["RolloutDriver"]

log = logging.getLogger(__name__)

Prompt = Delivery[trajectory_pb2.PromptTask]
_PROMPT_FIELD = re.compile(r"^prompts\[(\d+)\]")
STOP_GRACE_S = 5.0  # a stopping driver lets calls this close to done finish; the rest go back


class RolloutDriver:
    """One driver incarnation; `run()` returns when stopped (or raises what stopped it)."""

    def __init__(self, ctx: ServiceContext[RolloutSettings], settings: RolloutSettings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.stop = ctx.stop_event
        self.run_name = ctx.run_name
        self.bus: Bus | None = None
        # Instance names are every live replica of each (services/membership.py).
        self.peers = [
            PeerView(settings.sampler, kind="sampler", resolve=ctx.resolve),
            PeerView([settings.reward_service], kind="reward_service", resolve=ctx.resolve),
        ]
        self.env_servers: Balancer[str] | None = None
        if settings.env is not None:  # multi-turn: episodes on these env servers' text envs
            view = PeerView([settings.env.env_server], kind="env_server", resolve=ctx.resolve)
            self.peers.append(view)
            self.env_servers = Balancer(view, str, _no_close)
        self.members: Members | None = None
        self.samplers = SamplerPool(self.peers[0], timeout_s=settings.generate_timeout_s)
        self.rewards = RewardPool(self.peers[1], timeout_s=settings.score_timeout_s)
        self.pacer = Pacer.following(settings, self._sampler_version)
        self.watch = self.pacer.watch
        self.queue: PromptQueue | None = None
        self.stats: RolloutStats | None = None
        self.images: ImageStore | None = None  # the prompts' images, by digest
        self.tokenizer: Any = None
        self.eos_token_id: int | None = None
        self.prefix_caching = False  # the samplers' engines keep one (GetInfo)
        self._intake = asyncio.Lock()  # one worker at a time takes credit and prompts
        self._tasks: list[asyncio.Task[Any]] = []

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        if not self.ctx.nats_url:
            raise ConfigError(f"rollout {self.ctx.name}: needs a NATS url (RLFLEET_NATS_URL)")
        self.bus = await Bus.connect(self.ctx.nats_url, name=f"{self.ctx.name}-rollout")
        self.images = ImageStore(self.bus.payloads, self.run_name)
        try:
            if await self._prepare():
                await self._work()
        finally:
            await self._shutdown()

    async def _prepare(self) -> bool:
        """Wait for the peers, learn the sampler's version, set up the bus; False if stopped."""
        settings, bus, run = self.settings, self.bus, self.run_name
        assert bus is not None
        say = bus_say(bus, run, self.ctx.name)
        self.members = Members(bus, run)
        await self.members.start()
        for view in self.peers:
            view.follow(self.members)
            named = ", ".join(view.refs)
            if not await waiting(
                f"a live {view.kind} ({named})",
                view.wait(self.stop, settings.startup_timeout_s),
                say=say,
            ):
                return False
        peers = [("sampler", a, SAMPLER_SERVICE) for a in self.samplers.addresses]
        peers += [("reward service", a, REWARD_SERVICE) for a in self.rewards.addresses]
        if self.env_servers is not None:
            peers += [("env server", a, ENV_SERVICE) for a in self.env_servers.addresses]
        for what, address, service in peers:
            log.info("waiting for %s at %s", what, address)
            if not await waiting(
                f"{what} at {address} to become healthy",
                wait_healthy(what, address, service, self.stop, settings.startup_timeout_s),
                say=say,
            ):
                return False
        info = await self.samplers.info()
        self.prefix_caching = info.prefix_caching
        await self.watch.observe(int(info.policy_version))
        if settings.expert_completions or settings.env is not None:
            await self._load_tokenizer(info)
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])
        self._check_group_size(bus.max_payload)
        self._tasks.append(await stop_when_run_over(bus, run, self.stop))
        await self.watch.start(bus, run)
        if settings.groups_per_version:  # credit for groups the learner drops untrained
            await self.pacer.follow_drops(bus, run, self.ctx.name)
        if settings.feed:
            feeder = PromptFeeder(
                bus,
                run,
                settings.queue,
                settings.dataset,
                depth=settings.queue_depth,
                epochs=settings.epochs,
            )
            self._tasks.append(asyncio.create_task(feeder.run_until(self.stop), name="feeder"))
        self.queue = PromptQueue(
            bus,
            run,
            settings.queue,
            ack_wait_s=settings.prompt_ack_wait_s,
            prefetch=settings.prompts_per_call,
        )
        await self.queue.start()
        self.stats = RolloutStats(bus, run, self.ctx.name, settings.metrics_interval_s)
        log.info(
            "rollout %s: %s (%s, v%d), rewards from %s, G=%d, %d prompts/call x %d, feed %s",
            self.ctx.name,
            ", ".join(self.samplers.addresses),
            info.model_name,
            info.policy_version,
            ", ".join(self.rewards.addresses),
            settings.group_size,
            settings.prompts_per_call,
            settings.concurrency,
            "on" if settings.feed else "off",
        )
        return not self.stop.is_set()

    async def _load_tokenizer(self, info: sampler_pb2.GetInfoResponse) -> None:
        from transformers import AutoTokenizer

        path = self.settings.model_path
        try:
            self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
        except Exception as exc:
            raise ConfigError(
                f"model_path {path!r}: cannot load the tokenizer: {type(exc).__name__}: {exc}"
            ) from exc
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else next(iter(info.eos_token_ids), None)
        if self.eos_token_id is None:
            log.warning("tokenizer of %s has no EOS token: expert completions end without", path)

    def _check_group_size(self, max_payload: int) -> None:
        """Warn at start when a group of full-length completions would not fit one message
        (groups by reference, bus.v1.PayloadRef, are not implemented yet)."""
        settings = self.settings
        completions = settings.group_size + settings.expert_completions
        # Per token: int32 id, float32 logprob, bool mask, and about 4 bytes of text.
        worst = completions * settings.sampling.max_tokens * 13
        if worst > max_payload * 0.9:
            log.warning(
                "a group of %d completions of %d tokens can take about %d bytes, over the bus's "
                "max payload of %d: such groups are dropped; lower group_size or "
                "sampling.max_tokens, or raise the NATS server's max_payload",
                completions,
                settings.sampling.max_tokens,
                worst,
                max_payload,
            )

    async def _work(self) -> None:
        """Run the workers and the metrics loop until stopped or something fails."""
        workers = [
            asyncio.create_task(self._worker(), name=f"rollout-worker-{i}")
            for i in range(self.settings.concurrency)
        ]
        metrics = asyncio.create_task(self._report_loop(), name="rollout-metrics")
        for task in self._tasks:  # the feeder and status watcher: a failure stops the driver
            task.add_done_callback(self._stop_on_failure)
        stopped = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({*workers, metrics, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stop.set()
            stopped.cancel()
            # Calls about to finish may publish; the others are cut and their prompts go back.
            await asyncio.wait(workers, timeout=STOP_GRACE_S)
            for task in [*workers, metrics]:
                task.cancel()
            await asyncio.gather(*workers, metrics, return_exceptions=True)
        for task in [*workers, metrics, *self._tasks]:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def _stop_on_failure(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.stop.set()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # The last interval's numbers first: a close below that fails must not lose them.
        if self.stats is not None and self.bus is not None:
            with contextlib.suppress(Exception):
                await self.stats.report(self.watch.version)
        if self.queue is not None:
            await self.queue.close()
        await self.watch.close()
        await self.pacer.close()
        await self.samplers.close()
        await self.rewards.close()
        if self.members is not None:
            await self.members.close()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()

    async def _report_loop(self) -> None:
        assert self.stats is not None
        while True:
            await asyncio.sleep(max(0.0, self.stats.next_report - time.monotonic()))
            await self.stats.report(self.watch.version)

    async def _sampler_version(self) -> int:
        """The lowest weight version the samplers serve."""
        infos = [self.samplers.info(i) for i in range(len(self.samplers.addresses))]
        return min(int(info.policy_version) for info in await asyncio.gather(*infos))

    # ------------------------------------------------------------------ one call

    async def _worker(self) -> None:
        assert self.queue is not None
        settings = self.settings
        while not self.stop.is_set():
            async with self._intake:
                if not await self.pacer.wait_turn(self.stop):
                    return
                wanted = self.pacer.room(settings.prompts_per_call)
                batch = await self.queue.take(wanted, self.stop)
                self.pacer.count(len(batch), [group_id(self.run_name, d.message) for d in batch])
            if not batch:
                continue
            try:
                await self._roll(batch)
            except BaseException:
                await self.queue.nak([d for d in batch if not d.settled])
                raise

    async def _roll(self, batch: list[Prompt]) -> None:
        """Generate, score and publish the groups of ``batch``'s prompts, acking each."""
        assert self.queue is not None and self.stats is not None
        if self.settings.env is not None:
            await asyncio.gather(*(self._roll_episodes(delivery) for delivery in batch))
            return
        generated = await self._generate(batch)
        if generated is None:
            await self.queue.nak(batch)
            return
        batch, results = generated
        tasks = [d.message for d in batch]
        experts = [self._expert(task) for task in tasks]
        request = score_request(tasks, results, experts, self.settings.rewards)
        scores = await self._score(request, f"scoring {len(request.items)}")
        if scores is None:
            await self.queue.nak(batch)
            return
        groups = build_groups(self.run_name, self.ctx.name, tasks, results, experts, scores)
        for group, delivery in zip(groups, batch, strict=True):
            if await self._publish(group, delivery):
                await self.queue.ack([delivery])
                self.stats.published(group, self.watch.version)

    async def _generate(
        self, batch: list[Prompt]
    ) -> tuple[list[Prompt], list[sampler_pb2.PromptResult]] | None:
        """(prompts kept, their results); None when stopped. A prompt the sampler refuses on
        its own (INVALID_ARGUMENT on `prompts[i]`) is dropped and the rest asked again."""
        assert self.queue is not None and self.stats is not None
        settings = self.settings
        while batch:
            tasks = await self._with_images(batch)
            if not tasks:
                continue  # a prompt whose images are gone was dropped: ask for the rest
            request = generate_request(tasks, settings.sampling, settings.group_size, settings.seed)
            started = time.monotonic()
            try:
                answered = await call_with_retry(
                    functools.partial(self.samplers.generate, request),
                    f"generating {len(tasks)} prompts",
                    self.stop,
                )
            except InvalidArgument as exc:
                match = _PROMPT_FIELD.match(exc.field or "")
                if match is None or int(match.group(1)) >= len(batch):
                    raise
                bad = batch.pop(int(match.group(1)))
                log.error("dropping prompt %s: %s", prompt_key(bad.message), exc)
                await self.queue.term(bad)
                self.pacer.credit([group_id(self.run_name, bad.message)])  # no group will come
                continue
            if answered is None:
                return None
            address, response = answered
            self._check_response(address, response, len(batch))
            self.stats.generated(time.monotonic() - started, response.results)
            for result in response.results:
                for completion in result.completions:
                    await self.watch.observe(completion.end_policy_version)
            return batch, list(response.results)
        return None

    async def _with_images(self, batch: list[Prompt]) -> list[trajectory_pb2.PromptTask]:
        """The batch's tasks with their images' bytes; [] after dropping (from ``batch``) a
        prompt whose images the store no longer holds."""
        assert self.images is not None and self.queue is not None
        tasks = []
        for i, delivery in enumerate(batch):
            try:
                tasks.append(await with_image_bytes(delivery.message, self.images))
            except InvalidArgument as exc:
                log.error("dropping prompt %s: %s", prompt_key(delivery.message), exc)
                del batch[i]
                await self.queue.term(delivery)
                self.pacer.credit([group_id(self.run_name, delivery.message)])
                return []
        return tasks

    async def _roll_episodes(self, delivery: Prompt) -> None:
        """Play one task's group of episodes, publish it, ack the task. An env server that
        fails mid-group drops the group (counted) and its task goes back to the queue, to be
        played again elsewhere: never half a group, never one twice (its group_id is fixed)."""
        assert self.queue is not None and self.stats is not None
        assert self.env_servers is not None and self.settings.env is not None
        settings, env, task = self.settings, self.settings.env, delivery.message
        seed = dict(task.extra.items()).get(ENV_SEED_KEY)
        if not isinstance(seed, int | float):
            key = prompt_key(task)
            log.error("dropping prompt %s: no %s (the env_seeds dataset)", key, ENV_SEED_KEY)
            await self.queue.term(delivery)
            self.pacer.credit([group_id(self.run_name, task)])
            return
        limits = EpisodeLimits(env.max_turns, env.max_total_tokens, env.wall_clock_s)
        params = sampling_params(settings.sampling, 1, settings.seed, task)
        started = time.monotonic()
        try:
            # One sampler for the whole group: its prefix cache holds each conversation so far.
            async with (
                self.env_servers.use() as (address, _),
                self.samplers.balancer.use() as (_, sampler),
                TextSession(address, request_timeout_s=env.step_timeout_s) as session,
            ):
                info = await session.create(env.env_id, settings.group_size, kwargs=env.kwargs)
                tokens = ChatTokens(self.tokenizer, info.tools)
                # A turn ends where the template ends one (the env speaks next), not at EOS.
                params.stop_token_ids.extend(set(tokens.turn_end) - set(params.stop_token_ids))
                episodes = await play_group(
                    session,
                    int(seed),
                    settings.group_size,
                    tokens,
                    sampler_turns(sampler, params),
                    limits,
                )
        except Unavailable as exc:
            log.warning("group of %s dropped: %s", prompt_key(task), exc)
            self.stats.dropped_episodes(settings.group_size)
            # Its start is given back (pacing would otherwise wait for a group that never
            # comes) and the task goes back to the queue, counted again when taken again.
            self.pacer.credit([group_id(self.run_name, task)])
            await self.queue.nak([delivery])
            return
        sampled = sum(sum(e.loss_mask) for e in episodes)
        self.stats.generated(time.monotonic() - started, tokens=sampled)
        for episode in episodes:
            if episode.last_version is not None:
                await self.watch.observe(episode.last_version)
        scores: list[reward_pb2.ItemScore] = []
        if settings.rewards:  # reward functions on the transcripts, beside the env's reward
            request = transcript_score_request(task, episodes, settings.rewards)
            scored = await self._score(request, f"scoring {len(episodes)} transcripts")
            if scored is None:
                await self.queue.nak([delivery])
                return
            scores = scored
        group = episode_group(self.run_name, self.ctx.name, task, episodes, scores)
        self.stats.episodes([e.outcome for e in episodes])
        if self.prefix_caching:  # a hit rate of 0 would blame a cache that is not there
            self.stats.prompts_cached(
                sum(e.prompt_tokens for e in episodes), sum(e.cached_tokens for e in episodes)
            )
        if await self._publish(group, delivery):
            await self.queue.ack([delivery])
            self.stats.published(group, self.watch.version)

    async def _score(
        self, request: reward_pb2.ScoreRequest, what: str
    ) -> list[reward_pb2.ItemScore] | None:
        """The reward service's scores of ``request`` (retried); None when stopped."""
        assert self.stats is not None
        started = time.monotonic()
        scored = await call_with_retry(lambda: self.rewards.score_request(request), what, self.stop)
        if scored is None:
            return None
        self.stats.scored(time.monotonic() - started)
        return list(scored.results)

    def _check_response(
        self, address: str, response: sampler_pb2.GenerateResponse, prompts: int
    ) -> None:
        """A sampler that answers with the wrong shape is a bug: stop rather than mislabel."""
        counts = [len(r.completions) for r in response.results]
        if len(counts) != prompts or any(c != self.settings.group_size for c in counts):
            raise InvalidArgument(
                f"sampler {address}: Generate returned {counts} completions for {prompts} "
                f"prompts x n={self.settings.group_size}",
                field="results",
            )

    def _expert(self, task: trajectory_pb2.PromptTask) -> Expert | None:
        if not self.settings.expert_completions:
            return None
        text = expert_text(task)
        if text is None:
            return None
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return Expert(text=text, token_ids=np.asarray(ids, dtype=np.int32))

    async def _publish(self, group: trajectory_pb2.TrajectoryGroup, prompt: Prompt) -> bool:
        """Publish with the same msg_id on every retry (the stream drops repeats); False when
        the group cannot be sent (too large: its prompt is dropped with an error)."""
        assert self.bus is not None and self.queue is not None
        try:
            await self.bus.publish_with_retry(
                traj_subject(self.run_name),
                group,
                msg_id=group.group_id,
            )
        except InvalidArgument as exc:
            log.error("dropping prompt %s: its group %s", prompt_key(prompt.message), exc)
            await self.queue.term(prompt)
            self.pacer.credit([group.group_id])  # never reaches the learner
            return False
        return True


async def _no_close(_: str) -> None:
    """Env server addresses hold nothing to close (each group opens its own session)."""
