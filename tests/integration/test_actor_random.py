"""The game actor end to end: real env servers, a real nats-server, the random policy.

The actor runs in this process (its `main`, as `rlfleet serve game_actor` would run it); what
it publishes is read back from the bus the way the learner and the launcher's monitor read it:
fragments from a durable JetStream consumer, episode and metrics events from core NATS.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from common import tensor
from env_server.service import EnvServerSettings
from env_server.service import main as serve_envs
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from sampler.actors.actor import GameActor
from sampler.actors.settings import GameActorSettings
from services.bus import MSG_ID_HEADER, Bus, events_subject, stream_name, traj_subject
from services.ports import free_port
from services.registry import ServiceContext
from services.server import wait_for_health

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]

SERVERS = ("env-actor-a", "env-actor-b")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env_servers() -> AsyncIterator[dict[str, str]]:
    """Two env servers in this process: instance name -> address."""
    started = []
    for name in SERVERS:
        ctx = ServiceContext(
            name=name, kind="env_server", settings=EnvServerSettings(), port=free_port()
        )
        started.append((ctx, asyncio.create_task(serve_envs(ctx))))
    for ctx, _ in started:
        await asyncio.to_thread(wait_for_health, f"127.0.0.1:{ctx.port}", 30)
    yield {ctx.name: f"127.0.0.1:{ctx.port}" for ctx, _ in started}
    for ctx, task in started:
        ctx.stop_event.set()
        await asyncio.wait_for(task, 30)


def _run_name() -> str:
    return f"itest-actor-{uuid.uuid4().hex[:8]}"


def _context(
    run: str, nats_url: str, endpoints: dict[str, str], **settings: Any
) -> ServiceContext[GameActorSettings]:
    values = {"env_servers": list(endpoints), "env_id": "CartPole-v1", "seed": 0, **settings}
    return ServiceContext(
        name="actor-0",
        kind="game_actor",
        settings=GameActorSettings(**values),
        run_name=run,
        nats_url=nats_url,
        endpoints=endpoints,
    )


class Events:
    """Collects EpisodeStats and Metrics of a run from core NATS (subscribed before the run)."""

    def __init__(self) -> None:
        self.episodes: list[events_pb2.EpisodeStats] = []
        self.metrics: list[events_pb2.Metrics] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, bus: Bus, run: str) -> None:
        for kind, message_type, into in (
            ("episodes", events_pb2.EpisodeStats, self.episodes),
            ("metrics", events_pb2.Metrics, self.metrics),
        ):
            sub = await bus.subscribe(events_subject(run, kind), message_type)
            self._tasks.append(asyncio.create_task(self._collect(sub, into)))

    @staticmethod
    async def _collect(sub: Any, into: list[Any]) -> None:
        async with sub:
            async for delivery in sub:
                into.append(delivery.message)

    async def stop(self, bus: Bus) -> None:
        await bus.nc.flush()
        await asyncio.sleep(0.2)  # let the last events arrive
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _fragments(bus: Bus, run: str, count: int, timeout_s: float = 30.0) -> list[Any]:
    """`count` deliveries of the run's trajectory stream (durable consumer, acked)."""
    got: list[Any] = []
    stop = asyncio.Event()
    pull = bus.pull(
        stream_name(run),
        "test-learner",
        traj_subject(run),
        trajectory_pb2.RolloutFragment,
        timeout_s=0.2,
        stop_event=stop,
    )

    async def consume() -> None:
        async for delivery in pull:
            got.append(delivery)
            await delivery.ack()
            if len(got) >= count:
                stop.set()

    await asyncio.wait_for(consume(), timeout_s)
    return got


def _arr(msg: Any) -> np.ndarray:
    return tensor.decode_tree(msg) if hasattr(msg, "tensor") else tensor.decode(msg)


def _sessions_open(server: str) -> float:
    value = REGISTRY.get_sample_value("rlfleet_env_sessions_active", {"server": server})
    return value or 0.0


async def test_random_actor_publishes_fragments_and_episodes(
    nats_url: str, env_servers: dict[str, str]
) -> None:
    run, t_steps, n, total = _run_name(), 25, 8, 2000
    ctx = _context(
        run,
        nats_url,
        env_servers,
        num_envs=n,
        rollout_length=t_steps,
        total_steps=total,
        publish_fragments=True,
        stats_interval_s=0.2,
    )
    events = Events()
    async with Bus.connect(nats_url, name="test-reader") as bus:
        await events.start(bus, run)
        await asyncio.wait_for(GameActor(ctx, ctx.settings).run(), 60)
        await events.stop(bus)
        deliveries = await _fragments(bus, run, total // (t_steps * n))

    assert all(_sessions_open(name) == 0 for name in SERVERS)
    frags = [d.message for d in deliveries]
    assert [f.sequence for f in frags] == list(range(10))
    incarnation = frags[0].fragment_id.split("/")[2]
    for f, d in zip(frags, deliveries, strict=True):
        assert f.fragment_id == f"{run}/actor-0/{incarnation}/{f.sequence}"
        assert d.headers[MSG_ID_HEADER] == f.fragment_id
        assert (f.run, f.actor_id, f.env_id) == (run, "actor-0", "CartPole-v1")
        assert f.env_address == ",".join(env_servers.values())
        assert len(f.env_session_id.split(",")) == 2
        assert (f.num_steps, f.num_envs, f.policy_version) == (t_steps, n, 0)
        assert _arr(f.observations).shape == (t_steps, n, 4)
        assert _arr(f.actions).shape == (t_steps, n)
        assert set(np.unique(_arr(f.actions))) <= {0, 1}
        np.testing.assert_allclose(_arr(f.logprobs), np.log(0.5), rtol=1e-6)
        np.testing.assert_array_equal(_arr(f.rewards), 1.0)
        assert not f.HasField("values") and not f.HasField("bootstrap_values")
    # Consecutive fragments continue each other.
    for a, b in itertools.pairwise(frags):
        np.testing.assert_array_equal(_arr(b.observations)[0], _arr(a.next_observations))
    done = np.concatenate([_arr(f.terminated) | _arr(f.truncated) for f in frags])
    ids = np.concatenate([_arr(f.episode_ids) for f in frags])
    assert done.shape == (total // n, n)
    for env in range(n):
        np.testing.assert_array_equal(np.diff(ids[:, env]) > 0, done[:-1, env])

    # One EpisodeStats per ended episode, returns equal to lengths (CartPole: +1 per step).
    episodes = events.episodes
    assert len(episodes) == int(done.sum()) > 0
    assert all(e.source == "actor-0" and e.env_id == "CartPole-v1" for e in episodes)
    assert all(e.episode_return == e.length for e in episodes)
    assert not any(e.HasField("score") for e in episodes)  # CartPole reports no score
    steps = [e.env_steps for e in episodes]
    assert steps == sorted(steps) and steps[-1] <= total
    # Completed episodes cover each env's steps up to its last end.
    covered = sum(
        int(np.flatnonzero(done[:, env])[-1]) + 1 for env in range(n) if done[:, env].any()
    )
    assert sum(e.length for e in episodes) == covered

    # Metrics: periodic and final, with the CleanRL chart names.
    assert events.metrics and events.metrics[-1].step == total
    last = events.metrics[-1].scalars
    assert last["charts/SPS"] > 0
    assert last["charts/episodic_return"] == last["charts/episodic_length"] > 0
    assert "charts/episodic_score" not in last


async def test_a_snake_actor_publishes_episode_scores_and_their_mean(
    nats_url: str, env_servers: dict[str, str]
) -> None:
    run = _run_name()
    ctx = _context(
        run,
        nats_url,
        env_servers,
        env_id="Snake-v0",
        env_kwargs={"size": 5},
        num_envs=4,
        rollout_length=10,
        total_steps=1200,
        stats_interval_s=60.0,  # only the final report: it covers every episode below
    )
    events = Events()
    async with Bus.connect(nats_url, name="test-reader") as bus:
        await events.start(bus, run)
        await asyncio.wait_for(GameActor(ctx, ctx.settings).run(), 60)
        await events.stop(bus)
    episodes = events.episodes
    assert episodes and all(e.HasField("score") for e in episodes)
    # Snake: +1 per food, -1 for a crash: the score is the return plus one for crashed episodes.
    assert all(e.score == e.episode_return + (0 if e.truncated else 1) for e in episodes)
    assert any(e.score > 0 for e in episodes)
    last = events.metrics[-1].scalars
    recent = [e.score for e in episodes[-20:]]  # common.stats.WINDOW
    assert last["charts/episodic_score"] == pytest.approx(sum(recent) / len(recent))


async def test_actor_stops_when_the_run_is_done(nats_url: str, env_servers: dict[str, str]) -> None:
    run = _run_name()
    ctx = _context(run, nats_url, env_servers, num_envs=4, total_steps=0, stats_interval_s=60)
    events = Events()
    async with Bus.connect(nats_url, name="test-launcher") as bus:
        await events.start(bus, run)
        actor = asyncio.create_task(GameActor(ctx, ctx.settings).run())
        for _ in range(200):
            if events.episodes:
                break
            await asyncio.sleep(0.05)
        assert events.episodes, "the actor published no episode"
        assert not actor.done()
        done = events_pb2.RunStatus(run=run, state=events_pb2.RUN_STATE_DONE, source="test")
        await bus.publish_event(events_subject(run, "status"), done)
        await asyncio.wait_for(actor, 10)
        await events.stop(bus)
    assert ctx.stop_event.is_set()
    assert all(_sessions_open(name) == 0 for name in SERVERS)
    assert events.metrics  # the final report goes out on the way down


class KillableServer:
    """An env server subprocess that a test can kill hard and start again on the same port."""

    def __init__(self) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        argv = [sys.executable, "-m", "launch.cli", "serve", "env_server", "--name", "env-k"]
        argv += ["--port", self.address.rsplit(":", 1)[1]]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
        wait_for_health(self.address, 60)

    def kill(self) -> None:
        self.procs[-1].send_signal(signal.SIGKILL)
        self.procs[-1].wait(30)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


@pytest.fixture
def killable_server() -> Iterator[KillableServer]:
    server = KillableServer()
    server.start()
    yield server
    server.stop()


async def test_actor_survives_an_env_server_crash(
    nats_url: str, env_servers: dict[str, str], killable_server: KillableServer
) -> None:
    run, t_steps = _run_name(), 10
    endpoints = {SERVERS[0]: env_servers[SERVERS[0]], "env-k": killable_server.address}
    ctx = _context(
        run,
        nats_url,
        endpoints,
        num_envs=4,
        rollout_length=t_steps,
        publish_fragments=True,
        stats_interval_s=60,
        request_timeout_s=5,
    )
    actor = GameActor(ctx, ctx.settings)
    async with Bus.connect(nats_url, name="test-reader") as bus:
        await bus.ensure_stream(stream_name(run), [traj_subject(run)])  # as the learner does
        running = asyncio.create_task(actor.run())
        try:
            before = await _fragments(bus, run, 3)
            # A hard crash: the session stream breaks with no goodbye.
            killable_server.kill()
            await asyncio.to_thread(killable_server.start)
            after = await _fragments(bus, run, 6)
        finally:
            ctx.stop_event.set()
            await asyncio.wait_for(running, 30)

    assert actor.envs.links[1].reconnects == 1
    frags = [d.message for d in before + after]
    assert [f.sequence for f in frags] == sorted(f.sequence for f in frags)
    # Somewhere the crashed server's envs (2 and 3) were cut: truncated together at one tick,
    # with their last observations as finals; env 0 and 1 went on undisturbed.
    cuts = []
    for f in frags:
        truncated = _arr(f.truncated)
        for t in np.flatnonzero(truncated[:, 2] & truncated[:, 3]):
            cuts.append((f, t))
    assert cuts, "no truncation of the crashed server's envs"
    f, t = cuts[0]
    index = _arr(f.final_indices).tolist()
    assert {t * 4 + 2, t * 4 + 3} <= set(index)
    np.testing.assert_array_equal(_arr(f.rewards)[t, 2:], 0.0)
    assert len(set(frags[-1].env_session_id.split(","))) == 2
    assert frags[-1].env_session_id != frags[0].env_session_id
    ids = np.concatenate([_arr(f.episode_ids) for f in frags])
    assert (np.diff(ids[:, 2]) >= 0).all()


async def test_a_fragment_over_the_payload_limit_goes_by_reference(
    nats_url: str, env_servers: dict[str, str]
) -> None:
    run, t_steps, n = _run_name(), 6000, 8  # about 2 MB per fragment, over NATS's 1 MiB
    ctx = _context(
        run, nats_url, env_servers, num_envs=n, rollout_length=t_steps,
        total_steps=t_steps * n, publish_fragments=True,
    )  # fmt: skip
    async with Bus.connect(nats_url, name="test-reader") as bus:
        await asyncio.wait_for(GameActor(ctx, ctx.settings).run(), 120)
        (delivery,) = await _fragments(bus, run, 1)
    fragment = delivery.message
    assert delivery.headers.get("Rlfleet-Payload") == "ref"
    assert fragment.ByteSize() > bus.max_payload
    assert (fragment.num_steps, fragment.num_envs) == (t_steps, n)
    assert _arr(fragment.observations).shape == (t_steps, n, 4)
    assert all(_sessions_open(name) == 0 for name in SERVERS)
