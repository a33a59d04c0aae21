"""Membership (services/membership.py) on a real nats-server, and a game actor following it.

The actor names one env server instance; replicas of it join, drain and die while the actor
runs, and every fragment it publishes is checked: none missing, none doubled, each continuing
the one before, every moved env's episode ended with its final observation.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from common import tensor
from env_server.service import EnvServerSettings
from env_server.service import main as serve_envs
from rlfleet.bus.v1 import trajectory_pb2
from sampler.actors.actor import GameActor
from sampler.actors.settings import GameActorSettings
from services.bus import Bus, stream_name, traj_subject
from services.membership import (
    DRAINING,
    EXPIRY_S,
    HEARTBEAT_S,
    Balancer,
    Member,
    Members,
    PeerView,
    Registration,
    advertised_address,
)
from services.ports import free_port
from services.registry import ServiceContext

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="session")]

REPO = Path(__file__).resolve().parents[2]
INSTANCE = "env-m"


def _run() -> str:
    return f"itest-members-{uuid.uuid4().hex[:8]}"


async def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------- the registry itself


async def test_members_join_drain_leave_and_expire(nats_url: str) -> None:
    run = _run()
    member = Member(kind="env_server", name=INSTANCE, replica="a", address="10.0.0.1:1")
    async with Bus.connect(nats_url, name="test-watch") as bus:
        members = Members(bus, run)
        await members.start()
        try:
            assert members.live("env_server") == []
            first = Registration(bus, run, member, load=lambda: 7)
            await first.start()
            await _until(lambda: len(members.live("env_server")) == 1, 5, "first seen")
            [seen] = members.live("env_server", INSTANCE)
            assert (seen.address, seen.load, seen.replica) == ("10.0.0.1:1", 7, "a")
            assert members.live("env_server", "other") == [] and members.live("sampler") == []

            # A second replica of the instance, in its own process's connection.
            other_bus = await Bus.connect(nats_url, name="test-second")
            second = Registration(other_bus, run, Member("env_server", INSTANCE, "b", "10.0.0.2:1"))
            await second.start()
            await _until(lambda: len(members.live("env_server")) == 2, 5, "second seen")

            # A late watcher gets the current records at once.
            late = Members(bus, run)
            await late.start()
            assert [m.replica for m in late.live("env_server")] == ["a", "b"]
            await late.close()

            # Draining: no longer offered to consumers, still a live record.
            version = members.version
            assert await first.drain(lambda: True, 1.0)
            await _until(lambda: members.version > version, 5, "drain seen")
            assert [m.replica for m in members.live("env_server")] == ["b"]
            assert [m.state for m in members.live("env_server", serving=False)] == [
                DRAINING,
                "serving",
            ]
            await first.stop()  # a clean stop deletes the record at once
            await _until(lambda: len(members.live("env_server", serving=False)) == 1, 5, "gone")

            # A replica that dies without a word drops out when its heartbeats stop (while
            # others' go on: a view gone stale all at once waits longer, see _expire).
            third = Registration(bus, run, Member("env_server", INSTANCE, "c", "10.0.0.3:1"))
            await third.start()
            await _until(lambda: len(members.live("env_server")) == 2, 5, "third seen")
            await other_bus.close()
            started = time.monotonic()
            await _until(lambda: len(members.live("env_server")) == 1, EXPIRY_S + 4, "expired")
            assert time.monotonic() - started >= EXPIRY_S - 2 * HEARTBEAT_S
            assert [m.replica for m in members.live("env_server")] == ["c"]
            await second.stop()
            await third.stop()
        finally:
            await members.close()


async def test_peer_view_names_replicas_addresses_and_endpoints(nats_url: str) -> None:
    run = _run()
    endpoints = {"env-fixed": "127.0.0.1:9"}

    def resolve(ref: str) -> str:
        return ServiceContext("x", "game_actor", EnvServerSettings(), endpoints=endpoints).resolve(
            ref
        )

    async with Bus.connect(nats_url, name="test-peers") as bus:
        members = Members(bus, run)
        await members.start()
        view = PeerView([INSTANCE, "env-fixed", "10.9.9.9:5"], kind="env_server", resolve=resolve)
        view.follow(members)
        assert view.dynamic
        # Nothing registered: fixed endpoints and addresses only.
        assert view.addresses() == ["127.0.0.1:9", "10.9.9.9:5"]
        regs = [
            Registration(bus, run, Member("env_server", name, name + "-r", address))
            for name, address in ((INSTANCE, "10.0.0.5:1"), ("env-fixed", "10.0.0.6:1"))
        ]
        for reg in regs:
            await reg.start()
        await _until(lambda: "10.0.0.6:1" in view.addresses(), 5, "replicas seen")
        # A registered instance is its replicas, not its endpoint.
        assert view.addresses() == ["10.0.0.5:1", "10.0.0.6:1", "10.9.9.9:5"]
        for reg in regs:
            await reg.stop()
        await members.close()
    with pytest.raises(Exception, match="unknown service 'nowhere'"):
        PeerView(["nowhere"], kind="env_server", resolve=resolve).addresses()


async def test_advertised_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLFLEET_ADVERTISE_HOST", raising=False)
    assert advertised_address("127.0.0.1", 5, "nats://10.1.1.1:4222") == "127.0.0.1:5"
    assert advertised_address("0.0.0.0", 5, "nats://127.0.0.1:4222") == "127.0.0.1:5"
    assert advertised_address("::", 5, "nats://[::1]:4222") == "[::1]:5"
    monkeypatch.setenv("RLFLEET_ADVERTISE_HOST", "10.2.3.4")
    assert advertised_address("0.0.0.0", 7, None) == "10.2.3.4:7"


# ---------------------------------------------------------------------- an actor following it


class Replicas:
    """Replicas of one env server instance of a run: in this process or as killable
    processes, each registering itself in the run's membership."""

    def __init__(self, run: str, nats_url: str) -> None:
        self.run, self.nats_url = run, nats_url
        self.inproc: dict[str, tuple[ServiceContext[Any], asyncio.Task[None]]] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    async def start(self, replica: str, **settings: Any) -> None:
        ctx = ServiceContext(
            name=INSTANCE,
            kind="env_server",
            settings=EnvServerSettings(**{"drain_timeout_s": 20, **settings}),
            run_name=self.run,
            port=free_port(),
            nats_url=self.nats_url,
            replica=replica,
        )
        self.inproc[replica] = (ctx, asyncio.create_task(serve_envs(ctx)))

    def spawn(self, replica: str) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RLFLEET_LOG_LEVEL": "WARNING",
            "RLFLEET_RUN_NAME": self.run,
            "RLFLEET_NATS_URL": self.nats_url,
            "RLFLEET_REPLICA_NAME": replica,
        }
        cmd = [sys.executable, "-m", "services.serve", "env_server", "--name", INSTANCE]
        self.procs[replica] = subprocess.Popen(cmd, cwd=REPO, env=env)

    async def stop(self, replica: str) -> float:
        """Stop an in-process replica (it drains first); seconds it took."""
        ctx, task = self.inproc.pop(replica)
        started = time.monotonic()
        ctx.stop_event.set()
        await asyncio.wait_for(task, 30)
        return time.monotonic() - started

    def kill(self, replica: str) -> None:
        proc = self.procs.pop(replica)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    async def close(self) -> None:
        for replica in list(self.inproc):
            await self.stop(replica)
        for proc in self.procs.values():
            proc.kill()
            proc.wait(10)


def _sessions(replica: str) -> float:
    return REGISTRY.get_sample_value("rlfleet_env_sessions_active", {"server": replica}) or 0.0


@pytest_asyncio.fixture(loop_scope="session")
async def replicas(nats_url: str) -> AsyncIterator[Replicas]:
    group = Replicas(_run(), nats_url)
    yield group
    await group.close()


def _arr(msg: Any) -> np.ndarray:
    return tensor.decode_tree(msg) if hasattr(msg, "tensor") else tensor.decode(msg)


async def test_actor_spreads_over_replicas_as_they_join_drain_and_die(
    nats_url: str, replicas: Replicas
) -> None:
    run, n, t_steps = replicas.run, 6, 10
    await replicas.start("a")
    ctx = ServiceContext(
        name="actor-m",
        kind="game_actor",
        settings=GameActorSettings(
            env_servers=[INSTANCE],
            env_id="CartPole-v1",
            num_envs=n,
            rollout_length=t_steps,
            publish_fragments=True,
            stats_interval_s=0.5,
            colocated="off",
        ),
        run_name=run,
        nats_url=nats_url,
    )
    actor = GameActor(ctx, ctx.settings)
    running = asyncio.create_task(actor.run())
    links = lambda: sorted(link.address for link in actor.envs.links)  # noqa: E731
    address = {}
    reader = await Bus.connect(nats_url, name="test-count")

    async def fragments_made(count: int) -> None:
        """Wait until ``count`` more fragments are in the run's stream."""
        before = await _stored(reader, run)
        deadline = time.monotonic() + 30
        while await _stored(reader, run) < before + count:
            assert time.monotonic() < deadline, "no fragments"
            await asyncio.sleep(0.05)

    try:
        await _until(lambda: len(actor.envs.links) == 1, 30, "actor on replica a")
        address["a"] = links()[0]

        # A replica joins: the actor's envs spread over both, no restart.
        await replicas.start("b")
        await _until(lambda: len(links()) == 2, 15, "actor on a and b")
        assert _sessions("a") == 1 and _sessions("b") == 1
        assert sorted(link.num_envs for link in actor.envs.links) == [3, 3]
        await fragments_made(2)

        # One is stopped: it drains (the actor moves away) well before its drain timeout.
        took = await replicas.stop("b")
        assert took < 10, took
        assert links() == [address["a"]] and _sessions("b") == 0

        # One dies without a word: its envs move to the live one.
        replicas.spawn("c")
        await _until(lambda: len(links()) == 2, 60, "actor on a and c")
        await fragments_made(2)
        replicas.kill("c")
        await _until(lambda: links() == [address["a"]], 3 * EXPIRY_S, "actor back on a")
        assert actor.envs.links[0].num_envs == n
        await asyncio.sleep(1.0)  # a few more fragments on the one left
    finally:
        ctx.stop_event.set()
        await asyncio.wait_for(running, 30)
        await reader.close()

    async with Bus.connect(nats_url, name="test-frags") as bus:
        frags = await _all_fragments(bus, run)
    # Every fragment, in order, each continuing the last: nothing lost or doubled.
    assert [f.sequence for f in frags] == list(range(len(frags)))
    assert len(frags) >= 5
    servers = set()
    for a, b in itertools.pairwise(frags):
        np.testing.assert_array_equal(_arr(b.observations)[0], _arr(a.next_observations))
    for f in frags:
        assert (f.num_steps, f.num_envs) == (t_steps, n)
        servers.update(f.env_address.split(","))
        cut = _arr(f.truncated) & ~_arr(f.terminated)
        finals = _arr(f.final_indices) if f.HasField("final_indices") else np.zeros(0, np.int64)
        # Every truncation carries its final observation (bootstrapped, not lost).
        np.testing.assert_array_equal(np.sort(finals), np.flatnonzero(cut.ravel()))
    assert len(servers) == 3  # a, b and c each held envs at some point


async def test_a_replica_that_refuses_sessions_never_stops_the_actor(
    nats_url: str, replicas: Replicas
) -> None:
    await replicas.start("good")
    ctx = ServiceContext(
        name="actor-r",
        kind="game_actor",
        settings=GameActorSettings(
            env_servers=[INSTANCE], env_id="CartPole-v1", num_envs=6, colocated="off"
        ),
        run_name=replicas.run,
        nats_url=nats_url,
    )
    actor = GameActor(ctx, ctx.settings)
    running = asyncio.create_task(actor.run())
    try:
        await _until(lambda: len(actor.envs.links) == 1, 30, "actor on the good replica")
        good = actor.envs.links[0].address
        # A replica configured for fewer envs than the actor would give it: it refuses.
        await replicas.start("small", max_envs_per_session=1)
        await _until(lambda: bool(actor.envs._set_aside), 15, "the refusing replica set aside")
        [refused] = actor.envs._set_aside
        assert refused != good
        await asyncio.sleep(1.0)
        assert not running.done()  # still stepping, on the good one alone
        assert [link.address for link in actor.envs.links] == [good]
    finally:
        ctx.stop_event.set()
        await asyncio.wait_for(running, 30)


async def _stored(bus: Bus, run: str) -> int:
    try:
        info = await bus.js.stream_info(stream_name(run))
    except Exception:  # not created yet
        return 0
    return int(info.state.messages)


async def _all_fragments(bus: Bus, run: str) -> list[trajectory_pb2.RolloutFragment]:
    info = await bus.js.stream_info(stream_name(run))
    want = info.state.messages
    got: list[trajectory_pb2.RolloutFragment] = []
    stop = asyncio.Event()
    pull = bus.pull(
        stream_name(run),
        "test-reader",
        traj_subject(run),
        trajectory_pb2.RolloutFragment,
        timeout_s=0.2,
        stop_event=stop,
    )

    async def consume() -> None:
        async for delivery in pull:
            got.append(delivery.message)
            await delivery.ack()
            if len(got) >= want:
                stop.set()

    await asyncio.wait_for(consume(), 30)
    return sorted(got, key=lambda f: f.sequence)


# ---------------------------------------------------------------------- callers of replicas


class _Client:
    def __init__(self, address: str) -> None:
        self.address, self.calls, self.closed = address, 0, False

    async def close(self) -> None:
        self.closed = True


async def test_balancer_uses_replicas_as_they_join_and_leave(nats_url: str) -> None:
    run = _run()
    async with Bus.connect(nats_url, name="test-balance") as bus:
        members = Members(bus, run)
        await members.start()
        peers = PeerView(["reward"], kind="reward_service", resolve=lambda ref: "127.0.0.1:1")
        peers.follow(members)
        balancer: Balancer[_Client] = Balancer(peers, _Client, _Client.close)
        # None registered: the endpoint.
        assert balancer.addresses == ["127.0.0.1:1"]
        one = Registration(bus, run, Member("reward_service", "reward", "r1", "10.0.1.1:1"))
        await one.start()
        await _until(lambda: balancer.addresses == ["10.0.1.1:1"], 5, "r1 used")
        two = Registration(bus, run, Member("reward_service", "reward", "r2", "10.0.1.2:1"))
        await two.start()
        await _until(lambda: len(balancer.addresses) == 2, 5, "r2 used")

        # Calls in flight go to the least busy replica: two at once land on both.
        async with balancer.use() as (first, _), balancer.use() as (second, _):
            assert {first, second} == {"10.0.1.1:1", "10.0.1.2:1"}
            held = balancer.client(first)
            # The busy one leaves: no new call goes there, its client closes once idle.
            await (one if first == "10.0.1.1:1" else two).stop()
            await _until(lambda: first not in balancer.addresses, 5, "left")
            for _ in range(4):
                async with balancer.use() as (address, _):
                    assert address == second
            assert not held.closed
        assert held.closed
        await balancer.close()
        for reg in (one, two):
            await reg.stop()
        await members.close()


async def test_gateway_pool_follows_sampler_replicas(nats_url: str) -> None:
    from gateway.backends import BackendPool
    from tests.unit.test_gateway_fakes import FakeReplica

    run = _run()
    async with Bus.connect(nats_url, name="test-gw") as bus:
        members = Members(bus, run)
        await members.start()
        peers = PeerView(["sampler-0"], kind="sampler", resolve=lambda ref: "127.0.0.1:1")
        peers.follow(members)
        reg = Registration(bus, run, Member("sampler", "sampler-0", "s1", "10.0.2.1:1"))
        await reg.start()
        await _until(lambda: peers.addresses() == ["10.0.2.1:1"], 5, "s1")
        pool = BackendPool([FakeReplica(a) for a in peers.addresses()], health_interval_s=0.2)
        await pool.start()
        pool.follow(peers, FakeReplica)
        added = Registration(bus, run, Member("sampler", "sampler-0", "s2", "10.0.2.2:1"))
        await added.start()
        healthy = lambda: sorted(b.address for b in pool.healthy_backends())  # noqa: E731
        await _until(lambda: healthy() == ["10.0.2.1:1", "10.0.2.2:1"], 5, "s2 in rotation")
        await reg.stop()
        await _until(lambda: healthy() == ["10.0.2.2:1"], 5, "s1 out of rotation")
        assert [b.address for b in pool.backends] == ["10.0.2.2:1"]
        await pool.close()
        await added.stop()
        await members.close()


async def test_registering_never_holds_a_service_up_while_nats_is_away() -> None:
    """No NATS where the url points: the env server serves anyway (consumers reach it by its
    fixed address) and its registration keeps trying in the background."""
    from services.server import wait_for_health

    nowhere = f"nats://127.0.0.1:{free_port()}"
    ctx = ServiceContext(
        name="env-alone",
        kind="env_server",
        settings=EnvServerSettings(),
        run_name=_run(),
        port=free_port(),
        nats_url=nowhere,
    )
    serving = asyncio.create_task(serve_envs(ctx))
    try:
        await asyncio.to_thread(wait_for_health, f"127.0.0.1:{ctx.port}", 30)
    finally:
        ctx.stop_event.set()
        await asyncio.wait_for(serving, 30)
