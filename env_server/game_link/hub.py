"""The policy of every link of this server: one batched forward over all waiting observations.

The policy runs inside the env server, next to the links (see docs/design.md, GameLink): each
pass of the hub's loop takes every observation batch that is waiting, of every link (several
ticks of one pipelined link included: the policy is stateless), concatenates those of one env
id and runs one forward, so links share inference calls. The behaviours are the game actor's
(common.behaviour); with `policy: learner` the weights come from clients.learner.WeightFollower
and a newer version is swapped in between two passes. Until the first version has arrived
nothing is answered: replies wait for it (the proto's rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clients.learner import WeightFollower
from common.behaviour import Behaviour, Decision, RandomBehaviour, TorchBehaviour
from env_server.game_link.settings import GameLinkSettings
from services.errors import InvalidArgument, RlfleetError

__all__ = ["PolicyHub"]

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """The links of one env id: one policy, one forward per pass."""

    env_id: str
    observation_space: Any
    action_space: Any
    policy: TorchBehaviour | None = None
    randoms: dict[int, RandomBehaviour] = field(default_factory=dict)  # by batch size
    pending: list[tuple[np.ndarray, asyncio.Future[tuple[Decision, int]]]] = field(
        default_factory=list
    )
    error: RlfleetError | None = None


class PolicyHub:
    """Decisions for observation batches, batched across links; see the module docstring."""

    def __init__(self, settings: GameLinkSettings, follower: WeightFollower | None) -> None:
        self.settings = settings
        self.follower = follower
        self.version = 0
        self.ready = settings.policy == "random"  # a learner policy waits for its first version
        self._weights: dict[str, Any] | None = None
        self._groups: dict[str, _Group] = {}
        self._wake = asyncio.Event()
        self._new_version = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.forwards = 0  # policy passes (one per group per loop pass)
        self.decided = 0  # observation batches answered

    @property
    def has_values(self) -> bool:
        return self.settings.policy == "learner"

    @property
    def learner_done(self) -> bool:
        """The run is done: its learner takes no more fragments and publishes no more versions."""
        return self.follower is not None and self.follower.run_done.is_set()

    def start(self, stop: asyncio.Event) -> None:
        self._tasks.append(asyncio.create_task(self._loop(), name="game-link-hub"))
        if self.follower is not None:
            self._tasks.append(asyncio.create_task(self._follow(stop), name="game-link-weights"))
            self._tasks.append(asyncio.create_task(self._run_done(), name="game-link-run-done"))

    async def _run_done(self) -> None:
        assert self.follower is not None
        await self.follower.run_done.wait()
        self._new_version.set()  # what waits for a version stops waiting (wait_version)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for group in self._groups.values():
            for _, future in group.pending:
                future.cancel()

    def check_spaces(self, env_id: str, observation_space: Any, action_space: Any) -> None:
        """Join (or start) the group of env_id; its links must agree on the spaces."""
        group = self._groups.get(env_id)
        if group is None:
            group = _Group(env_id, observation_space, action_space)
            if self.settings.policy == "learner":
                group.policy = TorchBehaviour(
                    observation_space,
                    action_space,
                    self.settings.policy_config,
                    device=self.settings.device,
                    seed=self.settings.seed,
                )
                if self._weights is not None:
                    self._load(group, self._weights, self.version)
            self._groups[env_id] = group
            return
        if group.observation_space != observation_space or group.action_space != action_space:
            raise InvalidArgument(
                f"env_id {env_id!r} is linked with other spaces on this server "
                f"(observation {group.observation_space}, action {group.action_space}): one "
                "env id has one policy",
                field="hello.observation_space",
            )

    def spaces(self, env_id: str) -> tuple[Any, Any] | None:
        """The spaces games declared for env_id (kept for the server's life), or None."""
        group = self._groups.get(env_id)
        return None if group is None else (group.observation_space, group.action_space)

    def decide(self, env_id: str, obs: np.ndarray) -> asyncio.Future[tuple[Decision, int]]:
        """A future of (decision, policy version) for one link's batch [N, ...]."""
        future: asyncio.Future[tuple[Decision, int]] = asyncio.get_running_loop().create_future()
        self._groups[env_id].pending.append((obs, future))
        self._wake.set()
        return future

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.ready:
                continue  # woken again when the first version arrives
            await asyncio.sleep(0)  # let readers that are ready enqueue their batches too
            for group in self._groups.values():
                if group.pending:
                    self._forward(group)

    def _forward(self, group: _Group) -> None:
        batch, group.pending = group.pending, []
        batch = [(obs, f) for obs, f in batch if not f.done()]  # (a stream that ended)
        if not batch:
            return
        sizes = [len(obs) for obs, _ in batch]
        try:
            if group.error is not None:
                raise group.error
            obs = np.concatenate([o for o, _ in batch])  # (a copy: the wire's are read-only)
            policy = self._behaviour(group, len(obs))
            decision = policy.act(obs)
        except Exception as exc:
            error = (
                exc
                if isinstance(exc, RlfleetError)
                else RlfleetError(f"the policy failed: {type(exc).__name__}: {exc}")
            )
            if not isinstance(exc, RlfleetError):
                log.exception("policy forward for %s failed", group.env_id)
            for _, future in batch:
                future.set_exception(error)
            return
        self.forwards += 1
        self.decided += len(batch)
        start = 0
        for (_, future), size in zip(batch, sizes, strict=True):
            part = slice(start, start + size)
            start += size
            future.set_result(
                (
                    Decision(
                        decision.env_actions[part],
                        decision.actions[part],
                        decision.logprobs[part],
                        None if decision.values is None else decision.values[part],
                    ),
                    self.version,
                )
            )

    def _behaviour(self, group: _Group, size: int) -> Behaviour:
        if group.policy is not None:
            return group.policy
        random = group.randoms.get(size)
        if random is None:
            seed = self.settings.seed + len(group.randoms)
            random = group.randoms[size] = RandomBehaviour(group.action_space, size, seed)
        return random

    # ------------------------------------------------------------------ weights

    async def _follow(self, stop: asyncio.Event) -> None:
        assert self.follower is not None
        first = await self.follower.first(stop, self.settings.weights_timeout_s)
        if first is None:
            return
        self._apply(*first)
        while not stop.is_set():
            await self.follower.wait_newer(self.version, stop, 3600.0)
            pending = self.follower.take()
            if pending is not None:
                self._apply(*pending)

    def _apply(self, version: int, state: dict[str, Any]) -> None:
        self._weights, self.version = state, int(version)
        for group in self._groups.values():
            self._load(group, state, self.version)
        if not self.ready:
            log.info("game links: first policy v%d loaded", version)
        self.ready = True
        self._wake.set()
        self._new_version.set()

    def taken(self, producer: str) -> int | None:
        """The highest sequence of `producer`'s fragments the learner reports taking (with the
        newest version this hub fetched), or None before it reports any."""
        return self.follower.taken(producer) if self.follower is not None else None

    async def wait_version(self, version: int, timeout_s: float) -> bool:
        """Wait until `version` (or a newer one) is loaded (True), `timeout_s` passed or the
        run is done (False)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.version < version and not self.learner_done:
                    self._new_version.clear()
                    await self._new_version.wait()
        return self.version >= version

    def _load(self, group: _Group, state: dict[str, Any], version: int) -> None:
        assert group.policy is not None
        try:
            group.policy.load(state, version)
            group.error = None
        except RlfleetError as exc:
            group.error = RlfleetError(
                f"the policy for {group.env_id} cannot load v{version}: {exc}"
            )
            log.error("%s", group.error)
