"""GameLinkService against a real env server (service.main) on a loopback socket and a real bus.

The protocol's error cases are data (game_link_cases.json, shared with the other SDKs' tests):
each opens a stream, sends its steps and checks every response's result or in-band error code
and BadRequest field. The lifecycle rules are tests here: pipelining order, Goodbye/Farewell,
takeover (ABORTED), shutdown (UNAVAILABLE), limits (RESOURCE_EXHAUSTED), resume within the
window (seamless, mismatched, expired) checked on the rollout fragments the server publishes,
the spaces a learner asks EnvService for, and the Python SDK (clients/game_link.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import gymnasium as gym
import numpy as np
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2

from clients.game_link import AsyncGameLink, GameLink
from common import spaces, tensor
from env_server.game_link.settings import GameLinkSettings
from env_server.service import EnvServerSettings, main
from rlfleet.bus.v1 import events_pb2, trajectory_pb2
from rlfleet.env.v1 import env_pb2, env_pb2_grpc, game_link_pb2, game_link_pb2_grpc
from services.bus import Bus, events_subject, traj_subject
from services.errors import FailedPrecondition, InvalidArgument, Unavailable, from_status
from services.ports import free_port
from services.registry import ServiceContext
from services.server import channel, wait_for_health

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]

CASES = json.loads((Path(__file__).parent / "game_link_cases.json").read_text())["cases"]
OBS_SPACE = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACT_SPACE = gym.spaces.Discrete(3)
N = 2
T = 3  # rollout_length of the test server
WINDOW_S = 1.5


# --------------------------------------------------------------------------- the server


class Server:
    """An env server with game links in this process, and the fragments it publishes."""

    def __init__(
        self, nats_url: str, *, server: dict[str, Any] | None = None, **game_link: Any
    ) -> None:
        self.run = f"gl-{uuid.uuid4().hex[:8]}"
        settings = {
            "enabled": True,
            "policy": "random",
            "publish_fragments": True,
            "rollout_length": T,
            "max_agents_per_link": 8,
            "max_in_flight": 4,
            "resume_window_s": WINDOW_S,
            **game_link,
        }
        self.ctx = ServiceContext(
            name="env-gl",
            kind="env_server",
            settings=EnvServerSettings(game_link=GameLinkSettings(**settings), **(server or {})),
            port=free_port(),
            run_name=self.run,
            nats_url=nats_url,
        )
        self.address = f"127.0.0.1:{self.ctx.port}"
        self.fragments: dict[str, list[Any]] = collections.defaultdict(list)  # by link id
        self.arrived = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self.bus = await Bus.connect(self.ctx.nats_url or "", name="gl-test")
        sub = await self.bus.subscribe(traj_subject(self.run), trajectory_pb2.RolloutFragment)
        self._tasks.append(asyncio.create_task(self._collect(sub)))
        self._tasks.append(asyncio.create_task(main(self.ctx)))
        await asyncio.to_thread(wait_for_health, self.address, 30)

    async def _collect(self, sub: Any) -> None:
        async with sub:
            async for delivery in sub:
                self.fragments[delivery.message.env_session_id].append(delivery.message)
                self.arrived.set()

    async def stop(self) -> None:
        self.ctx.stop_event.set()
        await asyncio.wait_for(self._tasks[1], 30)
        await asyncio.sleep(0.2)  # the last fragments reach the subscription
        self._tasks[0].cancel()
        await asyncio.gather(self._tasks[0], return_exceptions=True)
        await self.bus.close()

    async def wait_fragments(self, link_id: str, count: int, timeout_s: float = 10.0) -> list[Any]:
        async with asyncio.timeout(timeout_s):
            while len(self.fragments[link_id]) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.fragments[link_id]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(nats_url: str) -> AsyncIterator[Server]:
    srv = Server(nats_url)
    await srv.start()
    yield srv
    await srv.stop()


@contextlib.asynccontextmanager
async def own_server(
    nats_url: str, *, server: dict[str, Any] | None = None, **game_link: Any
) -> AsyncIterator[Server]:
    srv = Server(nats_url, server=server, **game_link)
    await srv.start()
    try:
        yield srv
    finally:
        if not srv.ctx.stop_event.is_set():
            await srv.stop()


# --------------------------------------------------------------------------- a raw stream


class Stream:
    """One Connect call with raw protocol messages."""

    def __init__(self, address: str) -> None:
        self.channel = channel(address)
        self.call = game_link_pb2_grpc.GameLinkServiceStub(self.channel).Connect()
        self.ids = iter(range(1, 1 << 30))

    async def send(self, **request: Any) -> int:
        request_id = next(self.ids)
        await self.call.write(game_link_pb2.ConnectRequest(request_id=request_id, **request))
        return request_id

    async def recv(self) -> game_link_pb2.ConnectResponse:
        response = await asyncio.wait_for(self.call.read(), 10)
        assert response is not grpc.aio.EOF, "the stream ended"
        return response

    async def ask(self, **request: Any) -> game_link_pb2.ConnectResponse:
        request_id = await self.send(**request)
        response = await self.recv()
        assert response.request_id == request_id
        return response

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def hello(**fields: Any) -> game_link_pb2.Hello:
    msg = game_link_pb2.Hello(
        game="contract",
        env_id="Contract-v0",
        observation_space=spaces.to_proto(OBS_SPACE),
        action_space=spaces.to_proto(ACT_SPACE),
        num_agents=N,
        protocol_version=1,
    )
    for name, value in fields.items():
        if name in ("observation_space", "action_space"):
            getattr(msg, name).Clear()
            if value == "discrete":
                getattr(msg, name).CopyFrom(spaces.to_proto(gym.spaces.Discrete(3)))
        else:
            setattr(msg, name, value)
    return msg


def batch(
    tick: int,
    *,
    obs: np.ndarray | None = None,
    rewards: Any = 0.0,
    terminated: Any = False,
    truncated: Any = False,
    episode_ids: Any = (1, 2),
    tensors: dict[str, dict[str, Any]] | None = None,
    omit: tuple[str, ...] = (),
) -> game_link_pb2.ObservationBatch:
    arrays = {
        "observations": np.zeros((N, 3), np.float32) if obs is None else obs,
        "rewards": np.broadcast_to(np.asarray(rewards, np.float32), (N,)),
        "terminated": np.broadcast_to(np.asarray(terminated, bool), (N,)),
        "truncated": np.broadcast_to(np.asarray(truncated, bool), (N,)),
        "episode_ids": np.asarray(episode_ids, np.int64),
    }
    for name, change in (tensors or {}).items():
        array = arrays[name]
        array = np.zeros(change.get("shape", array.shape), change.get("dtype", array.dtype))
        if "values" in change:
            array[:] = [float(v) for v in change["values"]]
        arrays[name] = array
    msg = game_link_pb2.ObservationBatch(tick=tick)
    for name, array in arrays.items():
        if name in omit:
            continue
        if name == "observations":
            msg.observations.CopyFrom(tensor.encode_tree(array))
        else:
            getattr(msg, name).CopyFrom(tensor.encode(array))
    return msg


def field_of(status: Any) -> str | None:
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bad.field_violations[0].field
    return None


# --------------------------------------------------------------------------- the cases


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
async def test_protocol_case(server: Server, case: dict[str, Any]) -> None:
    stream = Stream(server.address)
    try:
        for i, step in enumerate(case["steps"]):
            where = f"{case['name']}, step {i}"
            if "hello" in step:
                response = await stream.ask(hello=hello(**step["hello"]))
            elif "observations" in step:
                spec = step["observations"]
                msg = batch(
                    spec["tick"],
                    terminated=spec.get("terminated", False),
                    truncated=spec.get("truncated", False),
                    episode_ids=spec.get("episode_ids", (1, 2)),
                    tensors=spec.get("tensor"),
                    omit=tuple(spec.get("omit", ())),
                )
                response = await stream.ask(observations=msg)
            elif "goodbye" in step:
                response = await stream.ask(goodbye=game_link_pb2.Goodbye())
            else:
                response = await stream.ask()
            expect = step["expect"]
            if "result" in expect:
                assert not response.HasField("error"), f"{where}: {response.error}"
                assert response.WhichOneof("result") == expect["result"], where
            else:
                assert response.HasField("error"), f"{where}: no error"
                code = grpc.StatusCode[expect["code"]].value[0]
                assert response.error.code == code, f"{where}: {response.error}"
                assert field_of(response.error) == expect["field"], f"{where}: {response.error}"
                assert response.WhichOneof("result") is None
    finally:
        await stream.close()


# --------------------------------------------------------------------------- lifecycle


async def test_actions_answer_every_agent_in_order(server: Server) -> None:
    stream = Stream(server.address)
    welcome = (await stream.ask(hello=hello(max_in_flight=3))).welcome
    assert welcome.max_in_flight == 3 and welcome.protocol_version == 1
    assert welcome.run == server.run and not welcome.resumed and welcome.resume_window_s == WINDOW_S
    ids = [await stream.send(observations=batch(t)) for t in (1, 2, 3)]  # pipelined
    replies = [await stream.recv() for _ in ids]
    assert [r.request_id for r in replies] == ids
    assert [r.actions.tick for r in replies] == [1, 2, 3]
    for reply in replies:
        actions = tensor.decode_tree(reply.actions.actions)
        assert actions.shape == (N,) and actions.dtype == np.int64
        assert ((actions >= 0) & (actions < 3)).all()
        assert reply.actions.policy_version == 0  # the random policy
    capped = Stream(server.address)
    assert (await capped.ask(hello=hello(max_in_flight=100))).welcome.max_in_flight == 4
    await capped.close()
    await stream.close()


async def test_goodbye_answers_in_flight_then_farewell_and_ok(server: Server) -> None:
    stream = Stream(server.address)
    key = uuid.uuid4().hex
    await stream.ask(hello=hello(session_key=key, max_in_flight=2))
    await stream.ask(observations=batch(1))
    await stream.send(observations=batch(2, terminated=(True, False)))
    await stream.send(goodbye=game_link_pb2.Goodbye(reason="done"))
    assert (await stream.recv()).actions.tick == 2
    farewell = (await stream.recv()).farewell
    assert (farewell.ticks, farewell.episodes) == (2, 1)
    assert await stream.call.read() is grpc.aio.EOF
    assert await stream.call.code() == grpc.StatusCode.OK
    await stream.close()
    again = Stream(server.address)  # Goodbye released the key: a fresh link
    assert not (await again.ask(hello=hello(session_key=key))).welcome.resumed
    await again.close()


async def test_takeover_ends_the_old_stream_aborted(server: Server) -> None:
    key = uuid.uuid4().hex
    old, new = Stream(server.address), Stream(server.address)
    first = (await old.ask(hello=hello(session_key=key))).welcome
    await old.ask(observations=batch(1))
    second = (await new.ask(hello=hello(session_key=key))).welcome
    assert second.resumed and second.link_id == first.link_id and second.last_tick == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await old.call.read()
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert (await new.ask(observations=batch(2))).actions.tick == 2
    await old.close()
    await new.close()


async def test_a_key_reused_by_another_game_starts_a_new_link(server: Server) -> None:
    key = uuid.uuid4().hex
    old, new = Stream(server.address), Stream(server.address)
    first = (await old.ask(hello=hello(session_key=key))).welcome
    second = (await new.ask(hello=hello(session_key=key, num_agents=1))).welcome
    assert not second.resumed and second.link_id != first.link_id
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await old.call.read()
    assert info.value.code() == grpc.StatusCode.ABORTED
    one = batch(1, obs=np.zeros((1, 3), np.float32), episode_ids=(1,), rewards=0.0)
    one.rewards.CopyFrom(tensor.encode(np.zeros(1, np.float32)))
    for name in ("terminated", "truncated"):
        getattr(one, name).CopyFrom(tensor.encode(np.zeros(1, bool)))
    assert (await new.ask(observations=one)).actions.tick == 1
    await old.close()
    await new.close()


def column(fragment: Any, name: str, agent: int) -> np.ndarray:
    return tensor.decode(getattr(fragment, name))[:, agent]


def obs_at(tick: int) -> np.ndarray:
    """Observations that say which tick they are from: agent k sees (tick, k, 0) / 100."""
    return np.array([[tick / 100, k / 100, 0.0] for k in range(N)], np.float32)


async def test_columns_are_per_agent_sequences(server: Server) -> None:
    """A done tick makes no step for its agent: agent 0's column skips it, agent 1's does not,
    and agent 1's extra transition waits for the next fragment."""
    stream = Stream(server.address)
    link = (await stream.ask(hello=hello())).welcome.link_id
    for t in range(1, 6):
        eids = (1 if t <= 2 else 3, 2)
        msg = batch(t, obs=obs_at(t), rewards=t, terminated=(t == 2, False), episode_ids=eids)
        assert (await stream.ask(observations=msg)).HasField("actions")
    (fragment,) = await server.wait_fragments(link, 1)
    assert column(fragment, "rewards", 0).tolist() == [2.0, 4.0, 5.0]
    assert column(fragment, "terminated", 0).tolist() == [True, False, False]
    assert column(fragment, "rewards", 1).tolist() == [2.0, 3.0, 4.0]
    observed = tensor.decode_tree(fragment.observations)
    assert observed[:, 0, 0].tolist() == pytest.approx([0.01, 0.03, 0.04])  # ticks 1, 3, 4
    assert observed[:, 1, 0].tolist() == pytest.approx([0.01, 0.02, 0.03])
    next_obs = tensor.decode_tree(fragment.next_observations)
    assert next_obs[:, 0].tolist() == pytest.approx([0.05, 0.04])
    episodes = tensor.decode(fragment.episode_ids)
    assert len({*episodes[:, 0].tolist(), *episodes[:, 1].tolist()}) == 3  # unique in the link
    await stream.close()


async def test_resume_continues_episodes_seamlessly(server: Server) -> None:
    key = uuid.uuid4().hex
    stream = Stream(server.address)
    link = (await stream.ask(hello=hello(session_key=key))).welcome.link_id
    for t in (1, 2, 3):
        await stream.ask(observations=batch(t, obs=obs_at(t), rewards=t))
    await stream.send(observations=batch(4, obs=obs_at(4), rewards=4))  # in flight at the break
    await stream.close()
    await asyncio.sleep(0.3)
    back = Stream(server.address)
    welcome = (await back.ask(hello=hello(session_key=key))).welcome
    assert welcome.resumed and welcome.link_id == link
    assert welcome.last_tick in (3, 4)  # 4 if its answer was written before the break
    for t in range(welcome.last_tick + 1, 7):
        await back.ask(observations=batch(t, obs=obs_at(t), rewards=t))
    (fragment,) = await server.wait_fragments(link, 1)
    # T transitions per agent from ticks 1..4, closed by the rewards of ticks 2..5: no break.
    assert fragment.num_steps == T and fragment.num_envs == N
    assert column(fragment, "rewards", 0).tolist() == [2.0, 3.0, 4.0]
    assert not column(fragment, "truncated", 0).any()
    next_obs = tensor.decode_tree(fragment.next_observations)
    assert next_obs[0].tolist() == pytest.approx(obs_at(4)[0].tolist())
    await back.close()


async def test_resume_that_does_not_continue_truncates(server: Server) -> None:
    key = uuid.uuid4().hex
    stream = Stream(server.address)
    link = (await stream.ask(hello=hello(session_key=key))).welcome.link_id
    for t in (1, 2, 3):
        await stream.ask(observations=batch(t, obs=obs_at(t), rewards=t))
    await stream.close()
    back = Stream(server.address)
    assert (await back.ask(hello=hello(session_key=key))).welcome.last_tick == 3
    for t in range(4, 9):  # new episodes for both agents
        await back.ask(observations=batch(t, obs=obs_at(t), episode_ids=(11, 12)))
    # The first fragment; the second (ticks 5-7, closed by tick 8) may be in by now as well.
    fragment = (await server.wait_fragments(link, 1))[0]
    # Episode 1: ticks 1, 2 complete (rewards 2, 3); the open decision of tick 3 is dropped and
    # the transition of tick 2 ends truncated with tick 3's observation as its final one.
    assert column(fragment, "rewards", 0).tolist() == [2.0, 3.0, 0.0]
    assert column(fragment, "truncated", 0).tolist() == [False, True, False]
    finals = tensor.decode(fragment.final_indices).tolist()
    assert finals == [1 * N + 0, 1 * N + 1]
    final_obs = tensor.decode_tree(fragment.final_observations)
    assert final_obs[0].tolist() == pytest.approx(obs_at(3)[0].tolist())
    episodes = tensor.decode(fragment.episode_ids)[:, 0]
    assert episodes[0] == episodes[1] != episodes[2]
    await back.close()


async def test_no_resume_within_the_window_ends_the_link(server: Server) -> None:
    key = uuid.uuid4().hex
    stream = Stream(server.address)
    link = (await stream.ask(hello=hello(session_key=key))).welcome.link_id
    for t in (1, 2, 3, 4):
        eids = (1 if t <= 3 else 5, 2)
        msg = batch(t, obs=obs_at(t), rewards=t, terminated=(t == 3, False), episode_ids=eids)
        assert (await stream.ask(observations=msg)).HasField("actions")
    await stream.close()
    await asyncio.sleep(WINDOW_S + 0.5)
    # Everything complete was published: agent 0 has 2 transitions (ended at tick 3, its next
    # episode's first decision dropped), agent 1 has 3 (the third truncated at tick 4).
    fragments = await server.wait_fragments(link, 2)
    total = sum(f.num_steps * f.num_envs for f in fragments)
    assert total == 2 + 3
    assert {(f.num_steps, f.num_envs) for f in fragments} == {(2, 2), (1, 1)}
    late = Stream(server.address)
    welcome = (await late.ask(hello=hello(session_key=key))).welcome
    assert not welcome.resumed and welcome.link_id != link
    await late.close()


async def test_limits_are_resource_exhausted(nats_url: str) -> None:
    async with own_server(nats_url, max_links=2) as srv:
        streams = [Stream(srv.address) for _ in range(3)]
        for stream in streams[:2]:
            assert (await stream.ask(hello=hello())).HasField("welcome")
        refused = await streams[2].ask(hello=hello())
        assert refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        await streams[0].ask(goodbye=game_link_pb2.Goodbye())
        assert (await streams[2].ask(hello=hello())).HasField("welcome")  # same stream, retried
        for stream in streams:
            await stream.close()


async def test_shutdown_ends_streams_unavailable_and_publishes(nats_url: str) -> None:
    async with own_server(nats_url) as srv:
        stream = Stream(srv.address)
        link = (await stream.ask(hello=hello(session_key="k"))).welcome.link_id
        for t in (1, 2, 3):
            await stream.ask(observations=batch(t))
        await srv.stop()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream.call.read()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Two complete transitions per agent, then truncated: published before the stop.
        (fragment,) = srv.fragments[link]
        assert (fragment.num_steps, fragment.num_envs) == (2, 2)
        assert tensor.decode(fragment.truncated)[-1].all()
        await stream.close()


async def test_replies_wait_for_the_first_policy_and_pacing(nats_url: str) -> None:
    """policy: learner. Nothing is answered before the learner's first version; replies name
    the version that chose them, fragments carry the critic's values, and with
    fragments_per_version 1 a link's second fragment holds its next reply until the next
    version (one update ahead of the learner, like the actors)."""
    from common.policies import PolicyConfig, build_policy
    from learner.weights import (
        SERVICE_NAME,
        WeightServicer,
        WeightStore,
        add_weight_service,
        announce,
    )
    from services.server import GrpcServer

    port = free_port()
    settings = {"policy": "learner", "learner": f"127.0.0.1:{port}", "fragments_per_version": 1}
    async with own_server(nats_url, **settings) as srv:
        store = WeightStore(srv.run, keep=4, start_version=5)
        weights = GrpcServer("learner-stand-in", port=port)
        weights.add_service(add_weight_service, WeightServicer(store), SERVICE_NAME)

        async def publish() -> int:
            net = build_policy(OBS_SPACE, ACT_SPACE, PolicyConfig())
            manifest = await asyncio.to_thread(store.publish, net.state_dict())
            await announce(srv.bus, srv.run, manifest, f"127.0.0.1:{port}")
            return int(manifest.version)

        async def held(tick: int) -> asyncio.Future[Any]:
            await stream.send(observations=batch(tick))
            reading = asyncio.ensure_future(stream.call.read())
            done, _ = await asyncio.wait([reading], timeout=1.0)
            assert not done, f"tick {tick} was answered at once"
            return reading

        stream = Stream(srv.address)
        welcome = (await stream.ask(hello=hello())).welcome
        assert welcome.policy_version == 0
        reading = await held(1)  # no policy yet
        first = await publish()
        await weights.start()
        weights.set_serving()
        try:
            assert (await asyncio.wait_for(reading, 30)).actions.policy_version == first == 5
            # Fragment 1 (ticks 1-3, cut at tick 4) is within the credit of v5, fragment 2
            # (ticks 4-6, cut at tick 7) asks for v6: tick 8 waits for it.
            for t in range(2, 8):
                assert (await stream.ask(observations=batch(t))).actions.policy_version == 5
            reading = await held(8)
            second = await publish()
            assert (await asyncio.wait_for(reading, 30)).actions.policy_version == second == 6
            fragments = await srv.wait_fragments(welcome.link_id, 2)
            assert [f.policy_version for f in fragments] == [5, 5]
            assert all(f.HasField("values") and f.HasField("bootstrap_values") for f in fragments)
        finally:
            await stream.close()
            await weights.stop(0)


async def test_learner_gets_the_spaces_of_a_linked_env_id(server: Server) -> None:
    env_id = f"Linked-{uuid.uuid4().hex[:6]}-v0"

    async def create() -> Any:
        async with channel(server.address) as ch:
            request = env_pb2.SessionRequest(
                request_id=1, create=env_pb2.CreateRequest(env_id=env_id, num_envs=1)
            )
            call = env_pb2_grpc.EnvServiceStub(ch).Session(iter([request]), timeout=10)
            async for response in call:
                return response

    before = await create()
    assert isinstance(from_status(before.error), Unavailable)  # no game yet: retry
    stream = Stream(server.address)
    await stream.ask(hello=hello(env_id=env_id))
    after = (await create()).create
    assert spaces.from_proto(after.observation_space) == OBS_SPACE
    assert spaces.from_proto(after.action_space) == ACT_SPACE
    await stream.close()


async def test_a_bad_client_does_not_disturb_another_link(server: Server) -> None:
    good, bad = Stream(server.address), Stream(server.address)
    await good.ask(hello=hello())
    await bad.ask(hello=hello())
    for t in range(1, 20):
        garbage = await bad.ask(observations=batch(t, tensors={"rewards": {"values": ["nan", 1]}}))
        assert garbage.HasField("error")
        assert (await good.ask(observations=batch(t))).actions.tick == t
    await good.close()
    await bad.close()


def nan_obs() -> np.ndarray:
    """Tick 1's observations with agent 1's NaN at [2]."""
    obs = obs_at(1)
    obs[1, 2] = np.nan
    return obs


async def test_nan_observations_are_refused_in_band_naming_agent_row_and_field(
    server: Server,
) -> None:
    stream = Stream(server.address)
    await stream.ask(hello=hello())
    refused = await stream.ask(observations=batch(1, obs=nan_obs()))
    assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert field_of(refused.error) == "observations.observations"
    assert "agent 1 (row 1): nan at [2] is not finite" in refused.error.message
    infinite = obs_at(1)
    infinite[0, 0] = -np.inf
    refused = await stream.ask(observations=batch(1, obs=infinite))
    assert "agent 0 (row 0): -inf at [0]" in refused.error.message
    # The stream survives and the refused tick was not taken: the same tick, fixed, is answered.
    assert (await stream.ask(observations=batch(1, obs=obs_at(1)))).actions.tick == 1
    await stream.close()


async def test_nonfinite_observations_clip_setting_replaces_them(nats_url: str) -> None:
    async with own_server(nats_url, server={"nonfinite_observations": "clip"}) as srv:
        stream = Stream(srv.address)
        link = (await stream.ask(hello=hello())).welcome.link_id
        for t in range(1, T + 2):
            obs = nan_obs() if t == 1 else obs_at(t)
            if t == 1:
                obs[0, 0] = np.inf
            assert (await stream.ask(observations=batch(t, obs=obs))).actions.tick == t
        (fragment,) = await srv.wait_fragments(link, 1)
        await stream.close()
    first = tensor.decode_tree(fragment.observations)[0]
    # inf becomes the space's bound (1.0), NaN becomes 0: the fragment holds no NaN.
    assert first.tolist() == [[1.0, 0.0, 0.0], pytest.approx([0.01, 0.01, 0.0])]


async def test_undecodable_bytes_end_only_their_stream(server: Server) -> None:
    good = Stream(server.address)
    await good.ask(hello=hello())
    async with channel(server.address) as ch:
        method = "/rlfleet.env.v1.GameLinkService/Connect"
        raw = ch.stream_stream(method, request_serializer=bytes, response_deserializer=bytes)
        call = raw()
        await call.write(b"\x0a\xff\xff\xff")  # a length-delimited field running off the end
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await good.ask(observations=batch(1))).actions.tick == 1
    await good.close()


# --------------------------------------------------------------------------- the Python SDK


class Proxy:
    """A TCP forwarder in front of the server whose connections the test can cut: a real
    network fault under the client (it sees the transport fail, UNAVAILABLE)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.cut()
        self.server.close()


def _play(
    address: str, ticks: int, *, break_at: int | None = None, cut: Any = None
) -> tuple[Any, int, int]:
    """A CartPole loop through the SDK; at tick `break_at` `cut()` drops its connection (a
    network fault) so the SDK reconnects and resumes."""
    env = gym.make("CartPole-v1")
    link = GameLink(
        address,
        game="cartpole-sdk",
        env_id="CartPoleSdk-v0",
        observation_space=env.observation_space,
        action_space=env.action_space,
        num_agents=1,
    )
    obs, _ = env.reset(seed=0)
    reward, term, trunc, episode, ended = 0.0, False, False, 0, 0
    for t in range(ticks):
        if t == break_at:
            cut()
        action = link.act(obs[None], [reward], [term], [trunc], [episode])
        if term or trunc:
            ended += 1
            obs, _ = env.reset()
            reward, term, trunc, episode = 0.0, False, False, episode + 1
            continue
        obs, step_reward, term, trunc, _ = env.step(int(action[0]))
        reward = float(step_reward)
    farewell = link.close("test over")
    return farewell, ended, link.reconnects


async def test_python_sdk_lock_step_and_reconnect(server: Server) -> None:
    proxy = Proxy(server.ctx.port)
    await proxy.start()
    loop = asyncio.get_running_loop()

    def cut() -> None:
        loop.call_soon_threadsafe(proxy.cut)

    address = f"127.0.0.1:{proxy.port}"
    try:
        farewell, ended, reconnects = await asyncio.to_thread(
            _play, address, 300, break_at=100, cut=cut
        )
    finally:
        await proxy.close()
    assert reconnects == 1
    assert farewell.ticks == 300 and farewell.episodes == ended > 0


def _bad_reward(address: str) -> str | None:
    link = GameLink(
        address,
        game="sdk",
        env_id="Contract-v0",
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        num_agents=N,
    )
    zeros = np.zeros((N, 3), np.float32)
    try:
        with pytest.raises(InvalidArgument) as info:
            link.act(zeros, [math.nan, 0.0], False, False, [1, 2])
        assert link.act(zeros, 0.0, False, False, [1, 2]).shape == (N,)  # still usable
        return info.value.field
    finally:
        link.close()


async def test_python_sdk_raises_in_band_errors(server: Server) -> None:
    assert await asyncio.to_thread(_bad_reward, server.address) == "observations.rewards"


async def test_python_sdk_asyncio_pipelined(server: Server) -> None:
    link = await AsyncGameLink.open(
        server.address,
        game="sdk-async",
        env_id="Contract-v0",
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        num_agents=N,
        max_in_flight=3,
    )
    assert link.link.max_in_flight == 3
    zeros = np.zeros((N, 3), np.float32)
    for tick in (1, 2, 3):
        await link.submit(tick, zeros, 0.0, False, False, [1, 2])
    with pytest.raises(FailedPrecondition):  # a fourth would exceed the granted window
        await link.submit(4, zeros, 0.0, False, False, [1, 2])
    answered = [await link.receive() for _ in range(3)]
    assert [tick for tick, _, _ in answered] == [1, 2, 3]
    assert all(actions.shape == (N,) for _, actions, _ in answered)
    farewell = await link.close("done")
    assert (farewell.ticks, farewell.episodes) == (3, 0)


async def test_a_games_score_reaches_its_episode_stats_and_none_is_unset(server: Server) -> None:
    sub = await server.bus.subscribe(
        events_subject(server.run, "episodes"), events_pb2.EpisodeStats
    )
    link = await AsyncGameLink.open(
        server.address,
        game="sdk-score",
        env_id="Scored-v0",
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        num_agents=N,
    )
    zeros = np.zeros((N, 3), np.float32)
    await link.act(zeros, 0.0, False, False, [1, 2], scores=[-1.0, -1.0])  # not an end: unread
    await link.act(zeros, 1.0, True, False, [1, 2], scores=[7.0, math.nan])  # agent 1: none
    await link.close("done")
    received: list[events_pb2.EpisodeStats] = []
    async with asyncio.timeout(10), sub:
        async for delivery in sub:
            if delivery.message.env_id == "Scored-v0":
                received.append(delivery.message)
            if len(received) == 2:
                break
    scores = [e.score if e.HasField("score") else None for e in received]
    assert sorted(scores, key=lambda s: s is None) == [7.0, None]  # no made-up 0 for agent 1
    assert all(not e.partial and e.length == 1 for e in received)
