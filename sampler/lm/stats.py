"""The engine's own numbers, published as `bus.v1.Metrics` every interval (source: the sampler).

Scalars (over the interval):
    sampler/prefix_cache_hit_rate   prompt tokens found in the prefix cache / prompt tokens
                                    (engines with a prefix cache, intervals with prompts)
    sampler/prompt_tokens_per_s     prompt tokens prefilled or found cached, per wall second
    sampler/queued                  engine requests admitted and not finished, at report time
The Metrics `step` is the engine's prompt tokens since it started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from google.protobuf import timestamp_pb2

from rlfleet.bus.v1 import events_pb2
from sampler.engines.base import GenerationEngine
from services.bus import Bus, events_subject
from services.errors import Unavailable

__all__ = ["EngineStats"]

log = logging.getLogger(__name__)


class EngineStats:
    """Differences of an engine's cumulative counts between reports."""

    def __init__(self, engine: GenerationEngine, queued: Callable[[], int]) -> None:
        self.engine = engine
        self.queued = queued
        self._mark = (time.monotonic(), 0, 0)

    def scalars(self, now: float | None = None) -> dict[str, float]:
        """The interval's scalars; starts the next interval."""
        now = time.monotonic() if now is None else now
        counts = self.engine.counts
        then, prompt0, cached0 = self._mark
        prompt = counts.prompt_tokens - prompt0
        cached = counts.cached_prompt_tokens - cached0
        self._mark = (now, counts.prompt_tokens, counts.cached_prompt_tokens)
        out = {
            "sampler/prompt_tokens_per_s": prompt / max(now - then, 1e-9),
            "sampler/queued": float(self.queued()),
        }
        if self.engine.info.prefix_caching and prompt:
            out["sampler/prefix_cache_hit_rate"] = cached / prompt
        return out

    async def publish_every(
        self, bus: Bus, run: str, source: str, interval_s: float, version: Callable[[], int]
    ) -> None:
        """Publish one Metrics event per ``interval_s`` until cancelled; one the bus cannot
        take (NATS restarting) is skipped."""
        subject = events_subject(run, "metrics")
        while True:
            await asyncio.sleep(interval_s)
            stamp = timestamp_pb2.Timestamp()
            stamp.GetCurrentTime()
            metrics = events_pb2.Metrics(
                run=run,
                source=source,
                step=self.engine.counts.prompt_tokens,
                time=stamp,
                policy_version=version(),
            )
            try:
                metrics.scalars.update(self.scalars())
                await bus.publish_event(subject, metrics)
            except Unavailable as exc:
                log.debug("engine metrics not published: %s", exc)
