"""Several data-parallel learner ranks: rank 0 runs the learner loop (bus, ledger, WeightService,
checkpoint metadata, versions); the others only train, on what rank 0 sends them.

How the group comes to be:

- under torchrun, an indexed Kubernetes Job or any launcher that sets ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT``, every process is one rank of that world;
- with ``ranks: N`` (``learner_ranks`` in a game job) and no such variables, the learner process
  becomes rank 0 and starts ranks 1..N-1 on this host itself (same command line), in its own
  process group, so the launcher stops, kills and restarts the whole group as one service.

Rank 0 sends its orders over a gloo group of its own (besides DeepSpeed's, which carries the
gradient all-reduce): ``train`` (the accepted batch, bit for bit, the progress the update reads
and the minibatch shuffle's generator state), ``save`` (DeepSpeed checkpoints are collective),
``wait`` (a heartbeat while rank 0 waits on the bus) and ``stop``. Every collective has a
timeout (``rank_timeout_s``): a rank that loses rank 0 fails instead of hanging, and rank 0 fails
when another rank is gone, so the launcher restarts the group, which resumes from the checkpoint.
The checkpoint directory must be one all ranks see (the run dir on shared storage).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from learner.consumer import seed_everything
from learner.engine import Engine, NonfiniteUpdate
from learner.workload import Progress, RunDirs, Workload
from services.bus.nats_server import parent_death_signal
from services.errors import InvalidArgument
from services.ports import free_port
from services.registry import ENV_LAUNCHER_PID, ENV_METRICS_PORT, ServiceContext
from services.server import GrpcServer

__all__ = ["RankSettings", "Ranks", "digest", "follow", "write_digest"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP_WAIT_S = 30.0  # how long rank 0 waits for the others to exit after "stop"


class RankSettings(Protocol):
    """What a workload's settings say about its ranks (any workload may run several)."""

    @property
    def ranks(self) -> int: ...
    @property
    def rank_timeout_s(self) -> float: ...


def digest(engine: Engine) -> str:
    """SHA-256 of the engine's parameters (names and bytes, in name order): equal on every rank
    as long as the ranks train in lockstep."""
    h = hashlib.sha256()
    for name, tensor in sorted(engine.named_weights(torch.float32).items()):
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


class Ranks:
    """This process's place in the group and the channel rank 0 sends its orders on."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.heartbeat_s = timeout_s / 4
        self.children: list[subprocess.Popen[bytes]] = []  # ranks this process started
        self._group: Any = None
        self._lock = asyncio.Lock()  # one broadcast at a time (heartbeats vs orders)

    @classmethod
    def start(cls, settings: RankSettings) -> Ranks | None:
        """None for one process; else this process's rank (starting ranks 1..N-1 first when
        ``settings.ranks`` asks for them and no launcher set up a world)."""
        env = os.environ
        if "WORLD_SIZE" in env and "RANK" in env:
            world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
            if settings.ranks not in (1, world):
                raise InvalidArgument(
                    f"ranks {settings.ranks} but the launcher started WORLD_SIZE={world} ranks"
                )
            return cls(rank, world, settings.rank_timeout_s) if world > 1 else None
        if settings.ranks == 1:
            return None
        ranks = cls(0, settings.ranks, settings.rank_timeout_s)
        ranks._spawn_others()
        return ranks

    def _spawn_others(self) -> None:
        """Become rank 0 of a world on this host and start the other ranks with this process's
        command line; they die with it (SIGKILL at its death)."""
        world = str(self.world)
        shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        shared.update(WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
        os.environ.update(shared, RANK="0", LOCAL_RANK="0")
        for rank in range(1, self.world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            env[ENV_LAUNCHER_PID] = str(os.getpid())  # their orphan watch follows rank 0
            env.pop(ENV_METRICS_PORT, None)  # rank 0's port: only rank 0 serves metrics
            self.children.append(
                subprocess.Popen(  # this very command line, run again
                    sys.orig_argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=parent_death_signal(signal.SIGKILL),
                )
            )
        log.info("rank 0 of %d: started ranks 1-%d on this host", self.world, self.world - 1)

    # ------------------------------------------------------------------ the channel

    def connect(self) -> None:
        """After the engine is built (DeepSpeed has joined the world): the orders' own gloo
        group. Collective: every rank calls it at the same point."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._group = dist.new_group(backend="gloo", timeout=timeout)

    def _broadcast(self, order: tuple[Any, ...] | None) -> tuple[Any, ...]:
        box = [order]
        dist.broadcast_object_list(box, src=0, group=self._group)
        assert box[0] is not None
        return box[0]

    def receive(self) -> tuple[Any, ...]:
        """Blocking (ranks > 0): rank 0's next order, or an error after ``timeout_s``."""
        return self._broadcast(None)

    async def send(self, *order: Any) -> None:
        """Rank 0: one order to every other rank."""
        self._check_children()
        async with self._lock:
            await asyncio.to_thread(self._broadcast, order)

    async def send_train(
        self, items: list[Any], progress: Progress, generator: torch.Generator
    ) -> None:
        """The batch and what ``Workload.train`` reads besides it (not the applied-id window)."""
        counters = Progress(updates=progress.updates, version=progress.version)
        counters.samples, counters.messages = progress.samples, progress.messages
        await self.send("train", items, counters, generator.get_state())

    async def while_waiting(self, awaitable: Awaitable[T]) -> T:
        """Rank 0: await ``awaitable`` (the bus), telling the others every ``heartbeat_s``
        that it is still there."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.heartbeat_s)
                if done:
                    return task.result()
                await self.send("wait")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _check_children(self) -> None:
        for rank, child in enumerate(self.children, start=1):
            if child.poll() is not None:
                raise RuntimeError(f"learner rank {rank} exited (code {child.returncode})")

    async def stop(self) -> None:
        """Rank 0, at its end: tell the others to exit, and wait for those it started."""
        wait_s = 0.0  # never connected (failed before the engine): nobody to tell
        if self._group is not None:
            wait_s = _STOP_WAIT_S
            with contextlib.suppress(Exception):  # a broken group: the others fail on their own
                await asyncio.wait_for(self.send("stop"), timeout=self.timeout_s)
        for child in self.children:
            try:
                await asyncio.to_thread(child.wait, wait_s)
            except subprocess.TimeoutExpired:
                log.warning("learner rank (pid %d) did not exit: killing it", child.pid)
                child.kill()
                await asyncio.to_thread(child.wait)


def write_digest(ranks: Ranks, engine: Engine, directory: Path, updates: int) -> None:
    """``<directory>/rank-<r>.json``: this rank's parameter digest at ``updates`` (at every
    checkpoint), so the ranks' lockstep can be checked from the run dir."""
    record = {
        "rank": ranks.rank,
        "world": ranks.world,
        "updates": updates,
        "sha256": digest(engine),
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{ranks.rank}.json"
    path.write_text(json.dumps(record) + "\n")


async def follow(ctx: ServiceContext[Any], workload: Workload, ranks: Ranks) -> None:
    """Ranks > 0: build the same engine (and restore the same checkpoint) as rank 0, then
    carry out its orders until it says stop. A SIGTERM is rank 0's to act on: it stops the
    group with a last checkpoint these ranks must take part in."""
    settings = workload.settings
    dirs = RunDirs.of(ctx.run_dir)
    await workload.setup()

    def build() -> Engine:
        seed_everything(settings.seed)
        engine = workload.build()
        engine.load(dirs.checkpoints)
        ranks.connect()
        return engine

    engine = await asyncio.to_thread(build)
    generator = torch.Generator()
    log.info("rank %d of %d following rank 0", ranks.rank, ranks.world)
    # The first rank on a host (a pod of an indexed Job) answers gRPC health on the service's
    # port, so one probe fits every pod; ranks sharing rank 0's host leave the port to it.
    health = None
    if os.environ.get("LOCAL_RANK", "0") == "0":
        health = GrpcServer(f"{ctx.name}-rank-{ranks.rank}", host=ctx.host, port=ctx.port)
        await health.start()
        health.set_serving()
    try:
        while True:
            order = await asyncio.to_thread(ranks.receive)
            kind = order[0]
            if kind == "train":
                _, items, progress, rng = order
                generator.set_state(rng)
                # A NaN/inf step stops the update on every rank alike (check_step agrees
                # across ranks); rank 0 alone counts it and decides whether the run fails.
                with contextlib.suppress(NonfiniteUpdate):
                    await asyncio.to_thread(workload.train, items, progress, generator)
            elif kind == "save":
                _, tag, updates = order
                await asyncio.to_thread(engine.save, dirs.checkpoints, tag, {})
                await asyncio.to_thread(write_digest, ranks, engine, dirs.learner, updates)
            elif kind == "stop":
                log.info("rank %d: rank 0 is done", ranks.rank)
                return
            elif kind != "wait":
                raise RuntimeError(f"rank {ranks.rank}: unknown order {kind!r} from rank 0")
    finally:
        if health is not None:
            await health.stop()
        engine.close()
