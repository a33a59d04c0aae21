"""The links of one env server: session keys, the resume window, takeover, limits, and where
their fragments and episode statistics go.

A link outlives its streams. When a stream breaks, the link waits `resume_window_s` for a Hello
with its session key (no key: it ends at once); a Hello with a key whose stream is still live
takes the link over (the old stream ends ABORTED). A link ends on Goodbye, when its window
passes, or when the server stops: its open episodes end truncated at their last complete
transition and everything it buffered goes out as fragments (LinkRecorder.drain), so a game
that never comes back loses no complete transition; nothing is published twice (fragment ids
are `<run>/<server>/link-<id>/<incarnation>/<sequence>`, the incarnation new at every start).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.behaviour import Decision
from common.fragments import FragmentArrays, FragmentMeta, build_fragment, producer_id
from common.stats import ActorStats
from env_server.game_link.hub import PolicyHub
from env_server.game_link.protocol import LinkSpec, Tick, TickCursor
from env_server.game_link.recorder import EpisodeEnd, LinkRecorder
from env_server.game_link.settings import GameLinkSettings
from services.bus import Bus, events_subject, traj_subject
from services.errors import ResourceExhausted, RlfleetError
from services.producers import PRODUCER_EVENTS, producer_record

__all__ = ["Link", "LinkRegistry", "Owner"]

log = logging.getLogger(__name__)

TAKEOVER_WAIT_S = 10.0


class Owner(Protocol):
    """The stream that drives a link (servicer._Stream)."""

    async def take_over(self) -> None:
        """End this stream ABORTED and return once it has let go of its link."""
        ...


@dataclass
class Link:
    link_id: str
    spec: LinkSpec
    recorder: LinkRecorder
    meta: FragmentMeta
    stats: ActorStats
    cursor: TickCursor = field(default_factory=TickCursor)
    owner: Owner | None = None
    sequence: int = 0  # of its next fragment
    expiry: asyncio.Task[None] | None = None
    ended: bool = False
    paced_base: int = -1  # pacing (see LinkRegistry.pace)
    paced_count: int = 0
    wanted: int | None = None  # the version its next decision waits for

    @property
    def actor_id(self) -> str:
        return self.meta.actor_id

    @property
    def producer(self) -> str:
        """Whose fragments these are, as the learner reports what it took (see pace)."""
        return producer_id(self.meta.run, self.meta.actor_id, self.meta.incarnation)


class LinkRegistry:
    """Every link of this server; see the module docstring."""

    def __init__(
        self,
        settings: GameLinkSettings,
        hub: PolicyHub,
        *,
        server: str,
        address: str,
        run: str,
        bus: Bus | None,
    ) -> None:
        self.settings, self.hub = settings, hub
        self.server, self.address, self.run, self.bus = server, address, run, bus
        self.incarnation = uuid.uuid4().hex[:12]
        self.links: dict[str, Link] = {}
        self.by_key: dict[str, Link] = {}
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[Callable[[], Awaitable[None]] | None] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self.published = 0  # fragments
        self.linked = asyncio.Event()  # set once a first game has linked

    def start(self) -> None:
        self._worker = asyncio.create_task(self._work(), name="game-link-outbox")

    # ------------------------------------------------------------------ opening

    async def open(self, spec: LinkSpec, owner: Owner) -> tuple[Link, bool]:
        """The link a Hello gets: resumed (True) or new."""
        link = self.by_key.get(spec.session_key) if spec.session_key else None
        if link is not None:
            if link.owner is not None:
                log.info("link %s: taken over by a new stream", link.link_id)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TAKEOVER_WAIT_S):
                        await link.owner.take_over()
                link.owner = None
            why = link.spec.differs_from(spec)
            if why is None and not link.ended:
                if link.expiry is not None:
                    link.expiry.cancel()
                    link.expiry = None
                link.owner = owner
                r = link.recorder
                link.cursor = TickCursor(
                    r.last_tick if r.ticks else None, r.last_episode_ids, r.last_done
                )
                log.info("link %s resumed after tick %d", link.link_id, r.last_tick)
                return link, True
            log.info("link %s: session key reused by another game (%s): ends", link.link_id, why)
            self.end(link)
        if len(self.links) >= self.settings.max_links:
            raise ResourceExhausted(
                f"server {self.server} has {len(self.links)} game links, the limit "
                f"(max_links={self.settings.max_links}); retry later or use another server"
            )
        self.hub.check_spaces(spec.env_id, spec.observation_space, spec.action_space)
        link_id = f"{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        actor_id = f"{self.server}/link-{link_id}"
        meta = FragmentMeta(
            self.run, actor_id, self.incarnation, spec.env_id, self.address, link_id
        )
        stats_bus = self.bus if self.settings.publishes else None
        link = Link(
            link_id=link_id,
            spec=spec,
            recorder=LinkRecorder(
                spec.num_agents,
                spec.observation_space,
                spec.action_space,
                self.settings.rollout_length,
                has_values=self.hub.has_values,
            ),
            meta=meta,
            stats=ActorStats(
                stats_bus, self.run, actor_id, spec.env_id, self.settings.stats_interval_s
            ),
            owner=owner,
        )
        self.links[link_id] = link
        if spec.session_key:
            self.by_key[spec.session_key] = link
        self.linked.set()
        self._report(f"game {spec.game} linked ({spec.env_id}, link {link_id})")
        log.info(
            "link %s: %s (%s), %d agents, key %s",
            link_id,
            spec.game,
            spec.env_id,
            spec.num_agents,
            "set" if spec.session_key else "none",
        )
        return link, False

    # ------------------------------------------------------------------ ticks

    def answered(self, link: Link, tick: Tick, decision: Decision, version: int) -> None:
        """Record an answered tick; queue the fragments and statistics it completes."""
        ended = link.recorder.record(tick, decision, version)
        link.stats.steps += link.spec.num_agents
        if ended:
            self._episodes(link, ended, version)
        while link.recorder.ready():
            self._fragment(link, *link.recorder.cut())
            self._credit(link)
        if time.monotonic() >= link.stats.next_report:
            stats = link.stats
            stats.next_report = time.monotonic() + stats.interval_s  # (report sets it again)
            self._post(lambda: stats.report(version))

    def _credit(self, link: Link) -> None:
        """Before the learner reports taking any of a link's fragments: after `k` fragments a
        link waits for version `base + ceil(k / per_version) - 1`, one update ahead."""
        per_version = self.settings.fragments_per_version
        if not per_version or self.settings.policy != "learner":
            return
        if link.paced_base < 0:
            link.paced_base = self.hub.version
        link.paced_count += 1
        link.wanted = link.paced_base + -(-link.paced_count // per_version) - 1

    async def pace(self, link: Link) -> None:
        """Hold the link's next decision while `2 * fragments_per_version` of its fragments
        are outstanding, built but not yet taken by the learner (WeightsPublished's
        taken_sequences): one update ahead, never more (the game actor's rule). Until the
        learner reports taking any (start-up, a learner restart), the version credit of
        `_credit` applies: counted from a start version, it holds a link that started late
        one fragment short of the learner's need for the whole run."""
        per_version = self.settings.fragments_per_version
        if not per_version or self.settings.policy != "learner" or self.hub.learner_done:
            return  # (once the run is done, a held game could not even say Goodbye)
        deadline = time.monotonic() + self.settings.version_wait_s
        while (taken := self.hub.taken(link.producer)) is not None:
            link.paced_base, link.paced_count, link.wanted = -1, 0, None  # fresh if needed again
            outstanding = link.sequence - (taken + 1)
            if outstanding < 2 * per_version:
                return
            left = deadline - time.monotonic()
            if left <= 0 or not await self.hub.wait_version(self.hub.version + 1, left):
                if self.hub.learner_done:
                    return
                log.warning(
                    "link %s: %d fragments outstanding and no new version for %gs: going on",
                    link.link_id,
                    outstanding,
                    self.settings.version_wait_s,
                )
                return
        await self._pace_on_versions(link)

    async def _pace_on_versions(self, link: Link) -> None:
        wanted = link.wanted
        if wanted is None or self.hub.version >= wanted:
            return
        if not await self.hub.wait_version(wanted, self.settings.version_wait_s):
            if self.hub.learner_done:
                return
            # The learner is slower than the credit assumes: count again from what is at hand.
            log.warning(
                "link %s: no weights v%d after %gs: pacing restarts from v%d",
                link.link_id,
                wanted,
                self.settings.version_wait_s,
                self.hub.version,
            )
            link.paced_base, link.paced_count, link.wanted = self.hub.version, 0, None

    def _episodes(self, link: Link, ended: list[EpisodeEnd], version: int) -> None:
        """Episode statistics; those the server cut off (a break, takeover, Goodbye, the link's
        end, an episode id changed without an end) go out `partial`: out of the mean return."""
        stats = link.stats
        whole = [e.as_tuple() for e in ended if not e.partial]
        cut = [e.as_tuple() for e in ended if e.partial]
        if whole:
            self._post(lambda: stats.episodes_ended(whole, version))
        if cut:
            self._post(lambda: stats.episodes_ended(cut, version, partial=True))

    def _fragment(self, link: Link, arrays: FragmentArrays, version: int) -> None:
        sequence, link.sequence = link.sequence, link.sequence + 1
        if self.bus is None or not self.settings.publishes:
            return
        fragment = build_fragment(link.meta, sequence, version, arrays)
        bus = self.bus
        subject = traj_subject(self.run)

        async def send() -> None:
            await bus.publish_with_retry(subject, fragment, msg_id=fragment.fragment_id)
            self.published += 1

        self._post(send)

    def _report(self, change: str) -> None:
        """Tell the run how many links feed it now (services/producers.py): `rlfleet up` says
        when the last one has gone and nothing feeds the learner any more."""
        if self.bus is None or not self.settings.publishes:
            return
        bus, subject = self.bus, events_subject(self.run, PRODUCER_EVENTS)
        record = producer_record(
            self.server, live=len(self.links), what="game links", change=change
        )
        self._post(lambda: bus.publish_event(subject, record))

    def _post(self, job: Callable[[], Awaitable[Any]]) -> None:
        self._outbox.put_nowait(job)  # type: ignore[arg-type]

    async def _work(self) -> None:
        """Publish in order, one at a time, off the streams' path."""
        while True:
            job = await self._outbox.get()
            if job is None:
                return
            try:
                await job()
            except RlfleetError as exc:
                log.error("game link: publishing failed: %s", exc)

    # ------------------------------------------------------------------ ending

    def detach(self, link: Link, owner: Owner, *, keep: bool) -> None:
        """`owner`'s stream ended without Goodbye; `keep`: wait for a resume (not at
        takeover or shutdown, where someone else decides)."""
        if link.owner is not owner:
            return
        link.owner = None
        if not keep or link.ended:
            return
        if not link.spec.session_key or self.settings.resume_window_s == 0:
            self.end(link)
            return
        link.expiry = asyncio.create_task(self._expire(link), name=f"expire-{link.link_id}")

    async def _expire(self, link: Link) -> None:
        await asyncio.sleep(self.settings.resume_window_s)
        link.expiry = None
        log.info("link %s: no resume within %gs: ends", link.link_id, self.settings.resume_window_s)
        self.end(link)

    def end(self, link: Link) -> None:
        """End the link: open episodes truncated, buffered transitions published."""
        if link.ended:
            return
        link.ended = True
        if link.expiry is not None and link.expiry is not asyncio.current_task():
            link.expiry.cancel()
        self.links.pop(link.link_id, None)
        if link.spec.session_key and self.by_key.get(link.spec.session_key) is link:
            del self.by_key[link.spec.session_key]
        recorder = link.recorder
        ended = recorder.end_episodes()
        if ended:
            self._episodes(link, ended, self.hub.version)
        for arrays, version in recorder.drain():
            self._fragment(link, arrays, version)
        log.info(
            "link %s ended: %d ticks, %d transitions, %d episodes, %d fragments",
            link.link_id,
            recorder.ticks,
            recorder.transitions,
            recorder.episodes,
            link.sequence,
        )
        self._report(f"link {link.link_id} ({link.spec.game}) ended")

    async def close(self) -> None:
        """End every link and publish what is queued (the server stops)."""
        for link in list(self.links.values()):
            self.end(link)
        self._outbox.put_nowait(None)
        if self._worker is not None:
            await self._worker
