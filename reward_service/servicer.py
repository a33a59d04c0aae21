"""`rlfleet.reward.v1.RewardService`: batched scoring with named reward functions.

A Score call is validated in full (validation.py), then every requested function runs over the
whole batch at once, concurrently with the others, each within its own time budget and isolated
from the server's event loop (runner.py: worker threads, a loop of its own for an async one).
A function's failure (whatever it raises, a timeout, being unavailable) is reported per item and
never fails the call. No function runs past the caller's deadline: its budget is cut to fit, so
the scores that are ready still get back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace

import grpc

from reward_service.rewards.registry import Kind, RewardFunction
from reward_service.runner import Outcome, RewardRunner
from reward_service.settings import RewardSettings
from reward_service.validation import default_timeout_s, validate
from rlfleet.reward.v1 import reward_pb2, reward_pb2_grpc
from services.errors import ResourceExhausted
from services.telemetry import metrics

__all__ = ["RewardService"]

log = logging.getLogger(__name__)

_ACTIVE = metrics.gauge("reward_requests_active", "Score calls being served.", ("server",))
# Served Score calls only (a call refused at the concurrency limit is not a latency): what the
# reward service's autoscaler targets (deploy/kubernetes). Buckets from rule rewards to model
# rewards and sandboxed code that take seconds.
_SCORE_SECONDS = metrics.histogram(
    "reward_score_seconds",
    "Time to score one Score call's whole batch, from its validation to its answer.",
    ("server",),
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
_KINDS = {
    Kind.RULE: reward_pb2.REWARD_KIND_RULE,
    Kind.PLUGIN: reward_pb2.REWARD_KIND_PLUGIN,
    Kind.MODEL: reward_pb2.REWARD_KIND_MODEL,
}


class RewardService(reward_pb2_grpc.RewardServiceServicer):
    """Serves Score and ListRewards over one registry of reward functions."""

    # Who may call, by certificate kind (services/security.py; the launcher may call all).
    CALLERS = dict.fromkeys(("Score", "ListRewards"), frozenset({"rollout", "lm_learner"}))

    def __init__(
        self,
        registry: Mapping[str, RewardFunction],
        settings: RewardSettings,
        *,
        name: str = "reward_service",
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.name = name
        self.active = 0
        self._gauge = _ACTIVE.labels(name)
        self._latency = _SCORE_SECONDS.labels(name)
        self.runner = RewardRunner(
            worker_threads=settings.worker_threads,
            max_threads_per_function=settings.max_threads_per_function,
            max_stuck_calls=settings.max_stuck_calls,
        )

    def close(self) -> None:
        """Stop the reward functions' worker threads and loops (after the server stopped)."""
        self.runner.close()

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        limit = self.settings.max_concurrent_requests
        if self.active >= limit:
            raise ResourceExhausted(
                f"server {self.name} is scoring {self.active} requests, its limit "
                f"(max_concurrent_requests={limit}); retry later"
            )
        self.active += 1
        self._gauge.set(self.active)
        started = time.perf_counter()
        try:
            return await self._score(request, context.time_remaining())
        finally:
            self._latency.observe(time.perf_counter() - started)
            self.active -= 1
            self._gauge.set(self.active)

    async def _score(
        self, request: reward_pb2.ScoreRequest, time_remaining: float | None
    ) -> reward_pb2.ScoreResponse:
        plan = validate(request, self.registry, self.settings)
        if time_remaining is not None:
            # Every function stops a little before the caller's deadline, so a slow one costs
            # its own scores, not the whole answer (which would arrive too late to be read).
            budget = max(0.0, time_remaining * 0.9 - 0.05)
            plan.calls[:] = [replace(c, timeout_s=min(c.timeout_s, budget)) for c in plan.calls]
        per_call: list[list[Outcome]] = await asyncio.gather(
            *(self.runner.run(call, plan.batch) for call in plan.calls)
        )
        response = reward_pb2.ScoreResponse(rewards=[call.to_proto() for call in plan.calls])
        for i in range(len(plan.batch)):
            result = response.results.add()
            total: float | None = None
            for call, outcomes in zip(plan.calls, per_call, strict=True):
                outcome = outcomes[i]
                score = result.scores.add(
                    name=call.reward.name, status=outcome.status, score=outcome.score
                )
                if outcome.error is not None:
                    score.error.CopyFrom(outcome.error)
                if outcome.status == reward_pb2.SCORE_STATUS_OK:
                    total = (total or 0.0) + call.weight * outcome.score
            if total is not None:
                result.total = total
        return response

    async def ListRewards(
        self, request: reward_pb2.ListRewardsRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListRewardsResponse:
        response = reward_pb2.ListRewardsResponse()
        for name in sorted(self.registry):
            reward = self.registry[name]
            info = response.rewards.add(
                name=name,
                kind=_KINDS[reward.kind],
                description=reward.description,
                extra_keys=list(reward.extra_keys),
            )
            timeout_s = default_timeout_s(reward, self.settings)
            info.default_timeout.FromNanoseconds(round(timeout_s * 1e9))
            if name in self.settings.rewards:
                info.default_weight = self.settings.rewards[name]
        return response
