"""Episode and throughput statistics of one actor or game link, as bus events.

Every ended episode goes out as `bus.v1.EpisodeStats` (core NATS: only live watchers need it),
and every `interval_s` a `bus.v1.Metrics` with the actor's env steps/s and the mean return and
length of its last 20 episodes, CleanRL's chart names (and charts/episodic_score, the mean game
score of those of them whose game reported one).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

from google.protobuf import timestamp_pb2

from rlfleet.bus.v1 import events_pb2
from services.bus import Bus, events_subject

__all__ = ["ActorStats", "EndedEpisode"]

log = logging.getLogger(__name__)

WINDOW = 20  # episodes averaged in charts/episodic_return, _length and _score

# (env or agent index, return, length, truncated[, score]): score None or left out when the game
# reports none.
EndedEpisode = tuple[int, float, int, bool] | tuple[int, float, int, bool, float | None]


class ActorStats:
    """Counts env steps and episodes; publishes EpisodeStats and periodic Metrics."""

    def __init__(
        self, bus: Bus | None, run: str, source: str, env_id: str, interval_s: float
    ) -> None:
        self.bus = bus
        self.run = run
        self.source = source
        self.env_id = env_id
        self.interval_s = interval_s
        self.steps = 0  # env steps of this actor (all its envs)
        self.episodes = 0
        self.returns: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.lengths: collections.deque[int] = collections.deque(maxlen=WINDOW)
        # Same window as the returns; None for episodes without a score (not averaged).
        self.scores: collections.deque[float | None] = collections.deque(maxlen=WINDOW)
        self.started = time.monotonic()
        self._mark_time = self.started
        self._mark_steps = 0
        self.next_report = self.started + interval_s
        self._episodes_subject = events_subject(run, "episodes")
        self._metrics_subject = events_subject(run, "metrics")

    async def episodes_ended(
        self,
        ended: Iterable[EndedEpisode],
        policy_version: int,
        *,
        partial: bool = False,
    ) -> None:
        """Publish one EpisodeStats per (env, return, length, truncated[, score]). `partial`:
        episodes the environment did not end (a game link cut them off): published marked so,
        and left out of the return, length and score means here and in the learner's."""
        now = _now()
        for row in ended:
            _, episode_return, length, truncated = row[:4]
            score = row[4] if len(row) == 5 else None
            self.episodes += 1
            if not partial:
                self.returns.append(episode_return)
                self.lengths.append(length)
                self.scores.append(score)
            if self.bus is None:
                continue
            await self.bus.publish_event(
                self._episodes_subject,
                events_pb2.EpisodeStats(
                    run=self.run,
                    source=self.source,
                    env_id=self.env_id,
                    episode_return=episode_return,
                    length=length,
                    env_steps=self.steps,
                    policy_version=policy_version,
                    truncated=truncated,
                    time=now,
                    partial=partial,
                    score=score,  # None leaves it unset: no made-up 0 for scoreless games
                ),
            )

    def scalars(self, now: float) -> dict[str, float]:
        """The Metrics scalars since the last report (SPS over that interval)."""
        elapsed = max(now - self._mark_time, 1e-9)
        out = {
            "charts/SPS": (self.steps - self._mark_steps) / elapsed,
            "charts/episodes": float(self.episodes),
        }
        if self.returns:
            out["charts/episodic_return"] = sum(self.returns) / len(self.returns)
            out["charts/episodic_length"] = sum(self.lengths) / len(self.lengths)
            scores = [s for s in self.scores if s is not None]
            if scores:  # absent, not 0, when no episode of the window had a score
                out["charts/episodic_score"] = sum(scores) / len(scores)
        return out

    async def report(self, policy_version: int, *, now: float | None = None) -> dict[str, float]:
        """Publish (and log) one Metrics event; restarts the SPS interval."""
        now = time.monotonic() if now is None else now
        scalars = self.scalars(now)
        self._mark_time, self._mark_steps = now, self.steps
        self.next_report = now + self.interval_s
        log.info(
            "%s: %d steps, %.0f steps/s, %d episodes, return %.1f (last %d)",
            self.source,
            self.steps,
            scalars["charts/SPS"],
            self.episodes,
            scalars.get("charts/episodic_return", float("nan")),
            len(self.returns),
        )
        if self.bus is not None:
            await self.bus.publish_event(
                self._metrics_subject,
                events_pb2.Metrics(
                    run=self.run,
                    source=self.source,
                    step=self.steps,
                    time=_now(),
                    scalars=scalars,
                    policy_version=policy_version,
                ),
            )
        return scalars

    def mean_sps(self) -> float:
        """Env steps/s since the actor started."""
        return self.steps / max(time.monotonic() - self.started, 1e-9)


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp
