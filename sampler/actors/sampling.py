"""How a game actor fills one fragment: in lock step, or double-buffered as Sample Factory does.

Lock step: one policy forward over all N envs, then one step of every env, and again; the env
servers idle while the policy infers and the policy idles while they step.

Double-buffered: the envs are two parts with their own sessions (EnvGroup(double_buffer=True)).
While one part's step is on the env servers (other processes, so other cores), the policy
infers on the other part, so stepping and inference overlap. Each part fills its own columns
of the fragment row by row (Rollout parts), so every column's steps stay consecutive. A part
whose T rows are full waits for the other: the actor publishes, paces and swaps weights with
no step in flight, so one policy version makes the whole fragment, exactly as in lock step
(one pipeline bubble per fragment).

Both return when the fragment is full or `account` says to stop (after the step in flight);
the caller publishes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np

from common.behaviour import Behaviour
from sampler.actors.envs import EnvGroup, TickEvents
from sampler.actors.rollout import Rollout
from services.telemetry import metrics

__all__ = ["ENV_WAIT_SECONDS", "Account", "DoubleBuffer", "fill_lock_step"]

# Called after every (part) step with its events and env step count; True = stop now.
Account = Callable[[TickEvents, int], Awaitable[bool]]

# The actor's time blocked on env servers per (part) step: what is left of a step once it
# overlapped with inference. Its rate is the share of the actor's time spent waiting, the signal
# that more env servers would add throughput (deploy/kubernetes autoscaling). Buckets from
# in-process envs to simulators that take seconds a step.
ENV_WAIT_SECONDS = metrics.histogram(
    "actor_env_wait_seconds",
    "Time a game actor waited for its env servers' answer to one step of its envs.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# Loop turns to give a part's step before inferring on the other part, so that its requests
# are out: the step's task runs its first link (a ring's doorbell is sent there) and starts the
# other links' tasks, a gRPC stream's request iterator writes its message one turn after that
# (and a second server's link one turn later). Inferring first would serialise the two again.
SEND_YIELDS = 3


async def fill_lock_step(
    policy: Behaviour, rollout: Rollout, envs: EnvGroup, account: Account
) -> None:
    """The hot loop: one decision and one concurrent step of every env per tick."""
    while not rollout.full:
        decision = policy.act(rollout.current_obs)
        out = rollout.record(decision)
        started = time.perf_counter()
        events = await envs.step(decision.env_actions, rollout.current_obs, out)
        ENV_WAIT_SECONDS.observe(time.perf_counter() - started)
        rollout.finish(events)
        if await account(events, envs.num_envs):
            return


class DoubleBuffer:
    """Two parts of the envs in flight alternately; `policies[p]` acts for part p (the same
    policy for both, or a RandomBehaviour sized to each part)."""

    def __init__(self, policies: list[Behaviour], rollout: Rollout, envs: EnvGroup) -> None:
        if len(envs.parts) != 2 or rollout.parts != envs.parts:
            raise ValueError("DoubleBuffer needs a two-part EnvGroup and a Rollout of its parts")
        self.policies, self.rollout, self.envs = policies, rollout, envs
        self.sizes = [cols.stop - cols.start for cols in envs.parts]
        self._env_actions: np.ndarray | None = None  # whole rows [N, ...]; parts write theirs

    async def _launch(self, part: int) -> asyncio.Future[TickEvents]:
        """Infer on the part's current row, record it, and put its step in flight."""
        rollout, cols = self.rollout, self.envs.parts[part]
        obs = rollout.row_obs(part)
        decision = self.policies[part].act(obs[cols])
        out = rollout.record(decision, part)
        env_actions = np.asarray(decision.env_actions)
        if self._env_actions is None:
            n = self.envs.num_envs
            self._env_actions = np.zeros((n, *env_actions.shape[1:]), env_actions.dtype)
        self._env_actions[cols] = env_actions
        task = asyncio.ensure_future(self.envs.step(self._env_actions, obs, out, part))
        for _ in range(SEND_YIELDS):
            await asyncio.sleep(0)
        return task

    async def fill(self, account: Account) -> None:
        """Fill the rest of the fragment: each part's next step is put in flight as soon as its
        last one is recorded, until both parts have their T rows."""
        rollout = self.rollout
        pending: dict[int, asyncio.Future[TickEvents]] = {}
        stopping = False
        try:
            for part in (0, 1):
                pending[part] = await self._launch(part)
            while pending:
                for part in (0, 1):
                    task = pending.pop(part, None)
                    if task is None:
                        continue
                    started = time.perf_counter()
                    events = await task
                    ENV_WAIT_SECONDS.observe(time.perf_counter() - started)
                    rollout.finish(events, part)
                    # Once told to stop, the step in flight still lands (as a lock-step tick
                    # completes), so a fragment that fills with it is still published.
                    stopping = await account(events, self.sizes[part]) or stopping
                    if not stopping and not rollout.part_full(part):
                        pending[part] = await self._launch(part)
        finally:
            # Only after an error: the other part's step is awaited, not cancelled (a
            # cancelled request would leave its answer unread on the session's stream).
            await asyncio.gather(*pending.values(), return_exceptions=True)
