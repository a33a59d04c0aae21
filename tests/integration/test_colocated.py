"""The co-located fast path (docs/colocated.md) against real env servers on this host: an actor
steps through the shared-memory ring when it may and over gRPC when told not to, bad offers and
packets get clear errors, and a client killed mid-step leaves the server serving and nothing in
/dev/shm."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import pytest_asyncio
from google.rpc import status_pb2
from gymnasium.vector import AutoresetMode
from prometheus_client import REGISTRY

from clients.env import EnvSession
from clients.env.shm_ring import DONE, STEP, host_id, layout_for
from env_server.colocated import RingServer, ServerRing
from env_server.pool import EnvPool
from env_server.service import EnvServerSettings
from env_server.service import main as serve_envs
from rlfleet.env.v1 import env_pb2
from sampler.actors.actor import GameActor
from sampler.actors.settings import GameActorSettings
from services.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.ports import free_port
from services.registry import ServiceContext
from services.server import wait_for_health

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]

AUTO, OFF = "env-colo-auto", "env-colo-off"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def servers() -> AsyncIterator[dict[str, str]]:
    """Two env servers in this process, `colocated: auto` and `colocated: off`."""
    started = []
    for name, mode in ((AUTO, "auto"), (OFF, "off")):
        settings = EnvServerSettings(colocated=mode)
        ctx = ServiceContext(name=name, kind="env_server", settings=settings, port=free_port())
        started.append((ctx, asyncio.create_task(serve_envs(ctx))))
    for ctx, _ in started:
        await asyncio.to_thread(wait_for_health, f"127.0.0.1:{ctx.port}", 30)
    yield {ctx.name: f"127.0.0.1:{ctx.port}" for ctx, _ in started}
    for ctx, task in started:
        ctx.stop_event.set()
        await asyncio.wait_for(task, 30)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"rlfleet_{name}", labels) or 0.0


async def _wait_for(check: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def _run_actor(servers: dict[str, str], server: str, colocated: str) -> dict[str, float]:
    """Run a random-policy actor on one server until it has stepped a while; its link gauges
    seen while it ran."""
    settings = GameActorSettings(
        env_servers=[server], env_id="CartPole-v1", num_envs=8, colocated=colocated
    )
    ctx = ServiceContext(
        name=f"actor-{colocated}", kind="game_actor", settings=settings, endpoints=servers
    )
    steps_before = _sample("env_steps_total", server=server)
    running = asyncio.create_task(GameActor(ctx, settings).run())
    try:
        await _wait_for(lambda: _sample("env_steps_total", server=server) >= steps_before + 800)
        seen = {t: _sample("actor_env_links", actor=ctx.name, transport=t) for t in ("shm", "grpc")}
    finally:
        ctx.stop_event.set()
        await asyncio.wait_for(running, 30)
    assert all(_sample("actor_env_links", actor=ctx.name, transport=t) == 0 for t in seen)
    return seen


async def test_an_actor_on_this_host_steps_through_shared_memory(
    servers: dict[str, str],
) -> None:
    accepted = _sample("env_colocate_offers_total", server=AUTO, outcome="accepted")
    seen = await _run_actor(servers, AUTO, "auto")
    assert seen == {"shm": 1.0, "grpc": 0.0}
    assert _sample("env_colocate_offers_total", server=AUTO, outcome="accepted") == accepted + 1
    # The ring closes before the pool (closed in a thread), and the slot is freed last.
    await _wait_for(lambda: _sample("env_sessions_colocated", server=AUTO) == 0)
    await _wait_for(lambda: _sample("env_sessions_active", server=AUTO) == 0)


async def test_colocated_off_in_the_actor_uses_grpc(servers: dict[str, str]) -> None:
    offers = _sample("env_colocate_offers_total", server=AUTO, outcome="accepted")
    seen = await _run_actor(servers, AUTO, "off")
    assert seen == {"shm": 0.0, "grpc": 1.0}
    assert _sample("env_colocate_offers_total", server=AUTO, outcome="accepted") == offers


async def test_a_server_with_colocated_off_declines_and_grpc_steps_on(
    servers: dict[str, str],
) -> None:
    seen = await _run_actor(servers, OFF, "auto")
    assert seen == {"shm": 0.0, "grpc": 1.0}
    async with EnvSession(servers[OFF]) as session:
        await session.create("CartPole-v1", 4, seed=0)
        assert not await session.colocate()
        assert "colocated: off" in session.colocate_reason
        await session.reset()
        assert (await session.step(np.zeros(4, np.int64))).observations.shape == (4, 4)
    assert _sample("env_colocate_offers_total", server=OFF, outcome="declined") >= 2


async def test_ring_and_grpc_steps_agree(servers: dict[str, str]) -> None:
    actions = np.random.default_rng(1).integers(0, 2, size=(300, 6))
    runs = []
    for colocated in (False, True):
        async with EnvSession(servers[AUTO]) as session:
            await session.create("CartPole-v1", 6, seed=3)
            if colocated:
                assert await session.colocate(slots=3), session.colocate_reason
            assert session.transport == ("shm" if colocated else "grpc")
            obs, _ = await session.reset()
            rows, episodes = [np.array(obs)], []
            for a in actions:
                result = await session.step(a)
                rows.append(np.array(result.observations))
                episodes += [(e.env_index, e.episode_return, e.length) for e in result.episodes]
                if result.final_observations is not None:
                    rows.append(np.array(result.final_observations))
            runs.append((np.concatenate(rows), episodes))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1] and runs[0][1]


async def test_ring_and_grpc_carry_the_same_episode_scores(servers: dict[str, str]) -> None:
    # Snake reports info["score"] (the ring's NaN-for-none column); CartPole reports none.
    actions = np.random.default_rng(2).integers(0, 3, size=(400, 4))
    runs = []
    for env_id in ("Snake-v0", "CartPole-v1"):
        for colocated in (False, True):
            async with EnvSession(servers[AUTO]) as session:
                await session.create(
                    env_id, 4, seed=5, kwargs={"size": 5} if "Snake" in env_id else None
                )
                if colocated:
                    assert await session.colocate(slots=2), session.colocate_reason
                await session.reset()
                scores = []
                for a in actions:
                    result = await session.step(a % 2 if env_id == "CartPole-v1" else a)
                    scores += [(e.env_index, e.score) for e in result.episodes]
                runs.append(scores)
    snake_grpc, snake_ring, cartpole_grpc, cartpole_ring = runs
    assert snake_grpc == snake_ring and any(score for _, score in snake_grpc)
    assert cartpole_grpc == cartpole_ring and cartpole_grpc
    assert all(score is None for _, score in cartpole_ring)


async def test_bad_offers_and_packets_get_clear_errors(servers: dict[str, str]) -> None:
    async with EnvSession(servers[AUTO]) as session:
        await session.create("CartPole-v1", 4, seed=0)
        await session.reset()
        with pytest.raises(InvalidArgument, match="slots"):
            await session._request(colocate=env_pb2.ColocateRequest(segment_name="x", doorbell="y"))
        assert await session.colocate()
        ring = session._ring
        assert ring is not None and ring._conn is not None
        with pytest.raises(InvalidArgument, match="value 7"):
            await session.step(np.full(4, 7))
        # A malformed doorbell packet is answered with an error, and the ring goes on.
        loop = asyncio.get_running_loop()  # the server's too: no blocking calls here
        ring._waiter = loop.create_future()  # where the ring's reader puts the next packet
        ring._conn.send(b"garbage")
        reply = await asyncio.wait_for(ring._waiter, 10)
        error = status_pb2.Status.FromString(reply[DONE.size :])
        assert DONE.unpack_from(reply)[4] > 0 and "doorbell packet" in error.message
        assert (await session.step(np.zeros(4, np.int64))).rewards.tolist() == [1.0] * 4
    offer = env_pb2.ColocateRequest(
        host_id="elsewhere", segment_name="s", segment_bytes=1, slots=2, doorbell="d"
    )
    async with EnvSession(servers[AUTO]) as session:
        await session.create("CartPole-v1", 4)
        answer = (await session._request(colocate=offer)).colocate
        assert not answer.accepted and "another host" in answer.reason
        offer.host_id = host_id() or ""
        with pytest.raises(InvalidArgument, match="segment_bytes 1 is not"):
            await session._request(colocate=offer)


async def test_a_step_abandoned_mid_wait_ends_the_ring_not_the_server(
    servers: dict[str, str],
) -> None:
    async with EnvSession(servers[AUTO]) as session:
        await session.create("CartPole-v1", 4, seed=0)
        await session.reset()
        assert await session.colocate()
        waiting = asyncio.ensure_future(session.step(np.zeros(4, np.int64)))
        await asyncio.sleep(0)  # sent, not answered yet
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.5)  # its answer comes in with no step waiting for it
        with pytest.raises(Unavailable, match="out of step"):
            await session.step(np.zeros(4, np.int64))
    async with EnvSession(servers[AUTO]) as session:  # the server serves on
        await session.create("CartPole-v1", 4, seed=0)
        await session.reset()
        assert await session.colocate()
        assert (await session.step(np.zeros(4, np.int64))).rewards.tolist() == [1.0] * 4


async def test_a_ring_over_the_servers_limit_is_resource_exhausted() -> None:
    pool = EnvPool(lambda: gym.make("CartPole-v1"), 4, autoreset_mode=AutoresetMode.SAME_STEP)
    layout = layout_for(pool.observation_space, pool.action_space, 4, 2)
    offer = env_pb2.ColocateRequest(
        host_id=host_id(), segment_name="s", segment_bytes=layout.total_bytes, slots=2
    )
    offer.doorbell = "d"
    with pytest.raises(ResourceExhausted, match="colocated_max_bytes"):
        ServerRing(
            pool,
            offer,
            pool_lock=threading.Lock(),
            server=RingServer(),
            max_bytes=layout.total_bytes - 1,
            on_steps=print,
            on_close=print,
        )
    pool.close()


_CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    from clients.env import EnvSession

    async def main():
        session = EnvSession(sys.argv[1])
        await session.create("CartPole-v1", 16, seed=0)
        assert await session.colocate(), session.colocate_reason
        await session.reset()
        print(session._ring.offer().segment_name, flush=True)
        while True:
            await session.step(np.ones(16, np.int64))

    asyncio.run(main())
    """
)


async def test_a_client_killed_mid_step_leaves_the_server_serving(
    servers: dict[str, str],
) -> None:
    address = servers[AUTO]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps_before = _sample("env_steps_total", server=AUTO)
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, address], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert client.stdout is not None
        segment = (await asyncio.to_thread(client.stdout.readline)).strip()
        assert segment, "the client did not start"
        await _wait_for(lambda: _sample("env_steps_total", server=AUTO) > steps_before + 1600)
        assert _sample("env_sessions_colocated", server=AUTO) == 1
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(30)
    await _wait_for(lambda: _sample("env_sessions_colocated", server=AUTO) == 0)
    await _wait_for(lambda: _sample("env_sessions_active", server=AUTO) == 0)
    assert not os.path.exists(os.path.join("/dev/shm", segment))
    async with EnvSession(address) as session:  # and the server serves the next client
        await session.create("CartPole-v1", 4, seed=0)
        assert await session.colocate()
        await session.reset()
        assert (await session.step(np.zeros(4, np.int64))).observations.shape == (4, 4)


@contextlib.contextmanager
def _server_process(name: str, **settings: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An env server in its own process (`settings`: RLFLEET_ENV_SERVER__* values)."""
    port = free_port()
    argv = [sys.executable, "-m", "launch.cli", "serve", "env_server", "--name", name]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env |= {f"RLFLEET_ENV_SERVER__{key.upper()}": value for key, value in settings.items()}
    server = subprocess.Popen([*argv, "--port", str(port)], env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for_health(f"127.0.0.1:{port}", 60)
        yield f"127.0.0.1:{port}", server
    finally:
        server.kill()
        server.wait(30)


async def test_a_server_killed_mid_step_is_unavailable_to_the_client() -> None:
    with _server_process("env-colo-k") as (address, server):
        session = EnvSession(address, request_timeout_s=20)
        await session.create("CartPole-v1", 16, seed=0)
        assert await session.colocate(), session.colocate_reason
        await session.reset()
        stepping = asyncio.create_task(_step_forever(session))
        await asyncio.sleep(0.5)
        assert not stepping.done()
        server.send_signal(signal.SIGKILL)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(stepping, 15)
        assert session.transport == "grpc"  # the ring is closed with the session
        await session.close()


async def test_busy_polling_rings_step_like_grpc_while_the_server_serves_grpc() -> None:
    """Two busy-polling rings at once (a double-buffered actor's halves: the server polls both)
    and a gRPC session beside them, which the polling must not starve."""
    actions = np.random.default_rng(2).integers(0, 2, size=(300, 6))

    async def run(address: str, busy_poll_us: int | None) -> np.ndarray:
        async with EnvSession(address) as session:
            await session.create("CartPole-v1", 6, seed=3)
            if busy_poll_us is not None:
                assert await session.colocate(busy_poll_us=busy_poll_us), session.colocate_reason
            obs, _ = await session.reset()
            rows = [np.array(obs)]
            for a in actions:
                rows.append(np.array((await session.step(a)).observations))
            return np.stack(rows)

    with _server_process("env-colo-poll", colocated_busy_poll_us="2000") as (address, _):
        polled, half_polled, plain = await asyncio.wait_for(
            asyncio.gather(run(address, 2000), run(address, 0), run(address, None)), 60
        )
    np.testing.assert_array_equal(polled, plain)
    np.testing.assert_array_equal(half_polled, plain)


async def _step_forever(session: EnvSession) -> None:
    while True:
        await session.step(np.ones(16, np.int64))


async def test_blocking_waits_step_like_awaited_ones_and_let_the_loop_run(
    servers: dict[str, str],
) -> None:
    """`block_us` (a lock-step actor's default) waits for answers in the kernel: the same
    steps as waiting in the event loop, and other tasks still run while it steps."""
    actions = np.random.default_rng(4).integers(0, 2, size=(400, 16))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def run(block_us: int) -> tuple[np.ndarray, int]:
        async with EnvSession(servers[AUTO]) as session:
            await session.create("CartPole-v1", 16, seed=5)
            assert await session.colocate(block_us=block_us), session.colocate_reason
            assert (session._ring._blocker is not None) == bool(block_us)  # type: ignore[union-attr]
            rows = [np.array((await session.reset())[0])]
            ticker = asyncio.create_task(tick())
            await asyncio.sleep(0)
            before = ticks
            for a in actions:
                rows.append(np.array((await session.step(a)).observations))
            ticked = ticks - before
            ticker.cancel()
            return np.stack(rows), ticked

    (blocked, ticked), (awaited, _) = await run(10_000), await run(0)
    np.testing.assert_array_equal(blocked, awaited)
    assert ticked >= 5, f"the event loop ran {ticked} times in 400 blocking steps"


class _SlowCartPole(gym.Wrapper):
    """CartPole whose steps take 0.3 s, recording when steps and close happen."""

    events: list[str] = []

    def step(self, action: Any) -> Any:
        self.events.append("step")
        time.sleep(0.3)
        self.events.append("stepped")
        return super().step(action)

    def close(self) -> None:
        self.events.append("close")
        super().close()


_SLOW = "rlfleet-test/SlowCartPole-v0"


@pytest.fixture
def slow_env() -> Iterator[str]:
    """_SlowCartPole registered with gymnasium (the in-process servers see it) for one test."""
    gym.register(_SLOW, entry_point=lambda **_: _SlowCartPole(gym.make("CartPole-v1")))
    yield _SLOW
    gym.registry.pop(_SLOW, None)


async def test_the_pool_is_never_used_by_a_ring_step_and_a_request_at_once(
    servers: dict[str, str], slow_env: str
) -> None:
    """While the ring server steps a pool, the session's gRPC requests are refused (not run
    beside it), and closing the session closes the pool only once the step is over."""
    _SlowCartPole.events.clear()
    async with EnvSession(servers[AUTO]) as session:
        await session.create(slow_env, 1, seed=0)
        await session.reset()
        assert await session.colocate()
        ring = session._ring
        assert ring is not None and ring._conn is not None
        ring._conn.send(STEP.pack(1, 1))  # a ring step no client call waits for
        await _wait_for(lambda: "step" in _SlowCartPole.events, 10)
        with pytest.raises(FailedPrecondition, match="one request at a time"):
            await session.reset()
        ring._conn.send(STEP.pack(2, 0))  # and one more under way as the session closes
        await _wait_for(lambda: _SlowCartPole.events.count("step") == 2, 10)
    await _wait_for(lambda: "close" in _SlowCartPole.events, 10)
    assert _SlowCartPole.events == ["step", "stepped", "step", "stepped", "close"]
