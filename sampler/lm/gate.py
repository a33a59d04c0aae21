"""Which weight version a generation runs on: a reader/writer gate around the engine.

Generations are readers, a weight update is the writer. The rule (sampler.proto, Completion
policy_version): a generation in flight when an update arrives finishes on the old weights and
reports the old version; one that arrives while the update waits or runs starts after it, on
the new version. So the writer waits for the readers inside to finish and, meanwhile, holds
new readers back (writer preference: a steady stream of requests cannot starve an update).

Chosen over vLLM's pause_generation/resume_generation: pausing with mode "keep" would switch
running sequences to the new weights mid-completion (a mixed-version completion, which the
learner would have to drop or correct), and "wait" is this same gate implemented inside one
engine, which the transformers engine does not have. The cost: an update waits for the longest
running generation (bounded by its max_tokens, or by the caller's `timeout`), and the samples
never straddle versions, so Completion.end_policy_version always equals policy_version.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["VersionGate"]


class VersionGate:
    """Readers share the engine at one version; `writing()` waits for them and excludes new
    ones until the new version is in."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._changed = asyncio.Condition()

    @property
    def readers(self) -> int:
        """Generations running now."""
        return self._readers

    @property
    def writers_waiting(self) -> int:
        """Updates waiting for the running generations to finish."""
        return self._writers_waiting

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[int]:
        """Hold the current version for one generation; yields that version."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield self.version
        finally:
            async with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Exclusive access for a weight update; set `version` inside."""
        async with self._changed:
            self._writers_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._writing and self._readers == 0)
            finally:
                self._writers_waiting -= 1
                self._changed.notify_all()  # readers held back by this writer may go on
            self._writing = True
        try:
            yield
        finally:
            async with self._changed:
                self._writing = False
                self._changed.notify_all()
