"""Rollout statistics of one driver, published as `bus.v1.Metrics` every interval.

Scalars (over the sampled completions since the last report; expert completions are left out,
they are not the policy's):
    reward/<name>, reward/<name>_std   raw score of each reward function (where it scored)
    reward/total, reward/total_std     weighted total (ItemScore.total, where set)
    reward/unscored_frac               completions without a total (left out of training)
    rollout/tokens_per_s               generated tokens / wall seconds inside Generate calls
    rollout/generate_s, rollout/score_s   mean wall seconds of one Generate / Score call
    rollout/groups                     groups published by this driver so far (cumulative)
    rollout/completion_len             mean completion length in tokens
    rollout/truncated_frac             completions stopped by max_tokens or the context length
    rollout/policy_lag                 mean of (newest announced version - sampling version)
    rollout/prefix_cache_hit_rate      multi-turn: prompt tokens of the episodes' turns that the
                                       sampler found in its prefix cache / prompt tokens sent
    episodes/<outcome>_frac            multi-turn: how the published groups' episodes ended
    episodes/dropped                   multi-turn: episodes lost with their env server
The Metrics `step` is the number of completions this driver has published.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Iterable

from google.protobuf import timestamp_pb2

from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.bus import Bus, events_subject

__all__ = ["RolloutStats"]

log = logging.getLogger(__name__)


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _length(token_ids: object) -> int:
    """T of an int32 [T] Tensor message (0 for an unset one)."""
    shape = token_ids.shape  # type: ignore[attr-defined]
    return int(shape[0]) if shape else 0


class RolloutStats:
    """Accumulates one interval's numbers; `report` publishes and resets them."""

    def __init__(self, bus: Bus | None, run: str, source: str, interval_s: float) -> None:
        self.bus = bus
        self.run = run
        self.source = source
        self.interval_s = interval_s
        self.groups = 0  # cumulative
        self.completions = 0  # cumulative (the Metrics step)
        self.next_report = time.monotonic() + interval_s
        self._subject = events_subject(run, "metrics")
        self._reset()

    def _reset(self) -> None:
        self._scores: dict[str, list[float]] = collections.defaultdict(list)
        self._totals: list[float] = []
        self._unscored = 0
        self._lengths: list[int] = []
        self._truncated = 0
        self._lags: list[int] = []
        self._generate_s: list[float] = []
        self._generated_tokens = 0
        self._score_s: list[float] = []
        self._outcomes: collections.Counter[str] = collections.Counter()  # multi-turn episodes
        self._dropped_episodes = 0
        self._prompt_tokens = 0  # multi-turn turns' prompts, and the part of them cached
        self._cached_tokens = 0

    def generated(
        self, seconds: float, results: Iterable[sampler_pb2.PromptResult] = (), tokens: int = 0
    ) -> None:
        """One Generate call took ``seconds`` and returned ``results`` (or a group of episodes
        took them and its model sampled ``tokens``)."""
        self._generate_s.append(seconds)
        self._generated_tokens += tokens
        for result in results:
            for completion in result.completions:
                self._generated_tokens += _length(completion.token_ids)

    def episodes(self, outcomes: Iterable[str]) -> None:
        """How a published group's multi-turn episodes ended (found, max_turns, ...)."""
        self._outcomes.update(outcomes)

    def prompts_cached(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Multi-turn turns sent ``prompt_tokens`` to the sampler, ``cached_tokens`` of them
        found in its prefix cache."""
        self._prompt_tokens += prompt_tokens
        self._cached_tokens += cached_tokens

    def dropped_episodes(self, count: int) -> None:
        """Episodes of a group lost with its env server (its task is played again)."""
        self._dropped_episodes += count

    def scored(self, seconds: float) -> None:
        self._score_s.append(seconds)

    def published(self, group: trajectory_pb2.TrajectoryGroup, announced_version: int) -> None:
        """Count a published group's sampled completions."""
        self.groups += 1
        for completion in group.completions:
            if completion.expert:
                continue
            self.completions += 1
            self._lengths.append(_length(completion.token_ids))
            self._truncated += completion.finish_reason == sampler_pb2.FINISH_REASON_LENGTH
            self._lags.append(announced_version - completion.policy_version)
            if completion.HasField("reward"):
                self._totals.append(completion.reward)
            else:
                self._unscored += 1
            for score in completion.rewards:
                if score.status == reward_pb2.SCORE_STATUS_OK:
                    self._scores[score.name].append(score.score)

    def scalars(self) -> dict[str, float]:
        out: dict[str, float] = {"rollout/groups": float(self.groups)}
        for name, values in sorted(self._scores.items()):
            out[f"reward/{name}"], out[f"reward/{name}_std"] = _mean_std(values)
        if self._totals:
            out["reward/total"], out["reward/total_std"] = _mean_std(self._totals)
        count = len(self._lengths)
        if count:
            out["reward/unscored_frac"] = self._unscored / count
            out["rollout/completion_len"] = sum(self._lengths) / count
            out["rollout/truncated_frac"] = self._truncated / count
            out["rollout/policy_lag"] = sum(self._lags) / count
        if self._generate_s:
            busy = sum(self._generate_s)
            out["rollout/generate_s"] = busy / len(self._generate_s)
            out["rollout/tokens_per_s"] = self._generated_tokens / max(busy, 1e-9)
        if self._score_s:
            out["rollout/score_s"] = sum(self._score_s) / len(self._score_s)
        episodes = sum(self._outcomes.values())
        for outcome, n in sorted(self._outcomes.items()):
            out[f"episodes/{outcome}_frac"] = n / episodes
        if self._prompt_tokens:
            out["rollout/prefix_cache_hit_rate"] = self._cached_tokens / self._prompt_tokens
        if self._dropped_episodes:
            out["episodes/dropped"] = float(self._dropped_episodes)
        return out

    async def report(self, policy_version: int) -> dict[str, float]:
        """Publish (and log) one Metrics event; starts the next interval."""
        scalars = self.scalars()
        self._reset()
        self.next_report = time.monotonic() + self.interval_s
        log.info(
            "%s: %d groups, reward %.3f, %.0f tokens/s, lag %.2f",
            self.source,
            self.groups,
            scalars.get("reward/total", math.nan),
            scalars.get("rollout/tokens_per_s", math.nan),
            scalars.get("rollout/policy_lag", math.nan),
        )
        if self.bus is not None:
            stamp = timestamp_pb2.Timestamp()
            stamp.GetCurrentTime()
            await self.bus.publish_event(
                self._subject,
                events_pb2.Metrics(
                    run=self.run,
                    source=self.source,
                    step=self.completions,
                    time=stamp,
                    scalars=scalars,
                    policy_version=policy_version,
                ),
            )
        return scalars
