"""EnvService against a real env_server (service.main) on a loopback socket.

Every bad request must get its own in-band error code and leave the stream serving; sessions
must be freed however a stream ends. The server runs in this process (on the test loop) so the
tests can register a misbehaving gymnasium env for it and read its Prometheus gauge.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import gymnasium as gym
import numpy as np
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from prometheus_client import REGISTRY

from clients.env import EnvSession, RemoteVectorEnv, env_spaces, list_envs
from common import tensor
from env_server.service import SERVICE_NAME, EnvServerSettings, main
from env_server.servicer import EnvService
from rlfleet.env.v1 import env_pb2, env_pb2_grpc
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlfleetError,
    Unavailable,
)
from services.ports import free_port
from services.registry import ServiceContext
from services.server import GrpcServer, channel

NAME = "env-contract"
MAX_SESSIONS = 3
MAX_ENVS = 32
RAISING_ID = "RlfleetTest/Raising-v0"
NESTED_ID = "RlfleetTest/Nested-v0"
NAN_ID = "RlfleetTest/NaN-v0"


class RaisingEnv(gym.Env):
    """Steps fine with action 0; action 1 raises, as a buggy user env would."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        if action == 1:
            raise ZeroDivisionError("the env divided by zero")
        return np.zeros(2, np.float32), 1.0, False, False, {}


class NestedEnv(gym.Env):
    """Dict observations (with Text) and Tuple actions: the nested wire format end to end.

    The observation echoes the last action, so the test can see that it arrived intact.
    """

    observation_space = gym.spaces.Dict(
        {
            "pos": gym.spaces.Box(-10.0, 10.0, (2,), np.float32),
            "last": gym.spaces.Discrete(3),
            "name": gym.spaces.Text(8, charset="abc"),
        }
    )
    action_space = gym.spaces.Tuple(
        [gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (2,), np.float32)]
    )

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return {"pos": np.zeros(2, np.float32), "last": 0, "name": "a"}, {}

    def step(self, action):
        self.t += 1
        choice, move = action
        obs = {"pos": np.asarray(move, np.float32), "last": int(choice), "name": "ab" * choice}
        return obs, float(choice), False, self.t >= 3, {"t": self.t}


class NanEnv(gym.Env):
    """A buggy simulation: action 1 makes its observation NaN at [2], action 2 +inf at [0]."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        obs = np.zeros(3, np.float32)
        if action == 1:
            obs[2] = np.nan
        elif action == 2:
            obs[0] = np.inf
        return obs, 1.0, False, False, {}


def register_test_envs() -> None:
    for env_id, entry_point in ((RAISING_ID, RaisingEnv), (NESTED_ID, NestedEnv), (NAN_ID, NanEnv)):
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=entry_point)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def address() -> AsyncIterator[str]:
    register_test_envs()
    settings = EnvServerSettings(
        max_sessions=MAX_SESSIONS, max_envs_per_session=MAX_ENVS, preload=["CartPole-v1"]
    )
    ctx = ServiceContext(name=NAME, kind="env_server", settings=settings, port=free_port())
    serving = asyncio.create_task(main(ctx))
    address = f"127.0.0.1:{ctx.port}"
    async with channel(address) as ch:  # wait until it answers
        stub = env_pb2_grpc.EnvServiceStub(ch)
        await stub.ListEnvs(env_pb2.ListEnvsRequest(filter="x"), wait_for_ready=True, timeout=30)
    yield address
    ctx.stop_event.set()
    await asyncio.wait_for(serving, 30)


def active_sessions() -> float:
    value = REGISTRY.get_sample_value("rlfleet_env_sessions_active", {"server": NAME})
    return value or 0.0


async def wait_active(expected: float, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while active_sessions() != expected:
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def session(address: str) -> AsyncIterator[EnvSession]:
    s = EnvSession(address, request_timeout_s=30)
    try:
        yield s
    finally:
        await s.close()


async def cartpole(address: str, n: int = 4, **kwargs) -> EnvSession:
    s = EnvSession(address, request_timeout_s=30)
    await s.create("CartPole-v1", n, **kwargs)
    await s.reset(seed=0)
    return s


async def assert_still_serving(s: EnvSession, n: int = 4) -> None:
    result = await s.step(np.zeros(n, np.int64))
    assert result.observations.shape == (n, 4)


async def test_list_envs(address: str) -> None:
    ids = [e.env_id for e in await list_envs(address)]
    assert "CartPole-v1" in ids and "FlappyBird-v0" in ids
    assert ids == sorted(ids)
    cart = [e for e in await list_envs(address, "cartpole-v1")]
    assert [e.env_id for e in cart] == ["CartPole-v1"]
    assert cart[0].max_episode_steps == 500 and cart[0].reward_threshold == 475.0


async def test_create_describes_the_pool(address: str) -> None:
    async with session(address) as s:
        info = await s.create("CartPole-v1", 5, seed=1)
        assert info.num_envs == 5
        assert info.action_space == gym.spaces.Discrete(2)
        assert info.observation_space == gym.make("CartPole-v1").observation_space
        assert info.autoreset_mode == gym.vector.AutoresetMode.SAME_STEP  # the default
        assert info.env.env_id == "CartPole-v1" and info.env.source == "gymnasium"


async def _rollout(address: str, seed: int, actions: np.ndarray) -> list[tuple]:
    async with session(address) as s:
        await s.create("CartPole-v1", actions.shape[1], seed=seed)
        obs, _ = await s.reset()
        out = [(obs.copy(),)]
        for a in actions:
            r = await s.step(a)
            final = None if r.final_observations is None else r.final_observations.copy()
            out.append(
                (
                    r.observations.copy(),
                    r.rewards.copy(),
                    r.terminated.copy(),
                    r.truncated.copy(),
                    final,
                    [e.env_index for e in r.episodes],
                )
            )
        return out


async def test_same_seed_same_sequence_as_local_sync_vector_env(address: str) -> None:
    n, seed = 6, 7
    actions = np.random.default_rng(1).integers(0, 2, size=(120, n))
    first = await _rollout(address, seed, actions)
    second = await _rollout(address, seed, actions)
    for a, b in zip(first, second, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)

    local = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * n, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    obs, _ = local.reset(seed=seed)
    np.testing.assert_array_equal(obs, first[0][0])
    ended_total = 0
    for a, remote in zip(actions, first[1:], strict=True):
        obs, rew, term, trunc, info = local.step(a)
        r_obs, r_rew, r_term, r_trunc, r_final, r_episodes = remote
        np.testing.assert_array_equal(obs, r_obs)
        np.testing.assert_array_equal(rew, r_rew)
        np.testing.assert_array_equal(term, r_term)
        np.testing.assert_array_equal(trunc, r_trunc)
        ended = np.flatnonzero(term | trunc)
        assert r_episodes == ended.tolist()
        for i in ended:
            np.testing.assert_array_equal(info["final_obs"][i], r_final[i])
        ended_total += len(ended)
    assert ended_total > 0  # the comparison covered autoresets
    local.close()


async def test_episode_returns_and_lengths(address: str) -> None:
    async with session(address) as s:
        await s.create("CartPole-v1", 2, seed=3)
        await s.reset()
        lengths = np.zeros(2, int)
        seen = []
        while len(seen) < 4:
            r = await s.step(np.ones(2, np.int64))  # always push right: short episodes
            lengths += 1
            for e in r.episodes:
                assert e.length == lengths[e.env_index] and e.episode_return == e.length
                assert not e.truncated
                seen.append(e)
                lengths[e.env_index] = 0


async def test_snake_episodes_carry_their_score_and_cartpoles_none(address: str) -> None:
    # Snake's info["score"] is the food eaten: the +1 rewards of the episode.
    rng = np.random.default_rng(0)
    async with session(address) as s:
        await s.create("Snake-v0", 4, seed=1, kwargs={"size": 5})
        await s.reset()
        eaten = np.zeros(4, int)
        seen: list[float] = []
        for _ in range(2000):
            r = await s.step(rng.integers(0, 3, 4))
            eaten += np.asarray(r.rewards) > 0
            for e in r.episodes:
                assert e.score is not None and e.score == eaten[e.env_index], e
                seen.append(e.score)
                eaten[e.env_index] = 0
            if len(seen) >= 20 and max(seen) > 0:
                break
        assert len(seen) >= 20 and max(seen) > 0  # some food eaten: not a made-up 0
    async with session(address) as s:
        await s.create("CartPole-v1", 2, seed=3)
        await s.reset()
        ended = []
        while len(ended) < 2:
            ended += (await s.step(np.ones(2, np.int64))).episodes
        assert all(e.score is None for e in ended)  # no info["score"]: no score


async def test_bad_actions_get_invalid_argument_and_the_stream_keeps_serving(
    address: str,
) -> None:
    s = await cartpole(address)
    try:
        with pytest.raises(InvalidArgument, match=r"expected shape \[4\], got \[3\]") as err:
            await s.step(np.zeros(3, np.int64))
        assert err.value.field == "actions"
        await assert_still_serving(s)
        with pytest.raises(InvalidArgument, match="expected an integer dtype"):
            await s.step(np.zeros(4, np.float32))
        await assert_still_serving(s)
        with pytest.raises(InvalidArgument, match=r"env 2: value 2 is outside \[0, 1\]"):
            await s.step(np.array([0, 1, 2, 0]))
        await assert_still_serving(s)
        # integer actions of another width are accepted and cast
        await s.step(np.array([0, 1, 1, 0], np.int8))
    finally:
        await s.close()


async def test_nan_in_continuous_action_names_the_env(address: str) -> None:
    async with session(address) as s:
        await s.create("Pendulum-v1", 3, seed=0)
        await s.reset()
        with pytest.raises(InvalidArgument, match="env 1: action contains NaN") as err:
            await s.step(np.array([[0.0], [np.nan], [1.0]], np.float32))
        assert err.value.field == "actions"
        with pytest.raises(InvalidArgument, match=r"env 0: .*inf"):
            await s.step(np.array([[np.inf], [0.0], [1.0]], np.float32))
        result = await s.step(np.array([[0.0], [0.5], [1.0]]))  # float64 accepted for float32
        assert result.observations.shape == (3, 3)


async def test_out_of_order_requests(address: str) -> None:
    async with session(address) as s:
        with pytest.raises(FailedPrecondition, match="step before create"):
            await s.step(np.zeros(1, np.int64))
        with pytest.raises(FailedPrecondition, match="reset before create"):
            await s.reset()
        await s.create("CartPole-v1", 2)
        with pytest.raises(FailedPrecondition, match="step before reset"):
            await s.step(np.zeros(2, np.int64))
        with pytest.raises(FailedPrecondition, match="create only once"):
            await s.create("CartPole-v1", 2)
        await s.reset(seed=1)
        await assert_still_serving(s, 2)


async def test_unknown_env_id_is_not_found(address: str) -> None:
    async with session(address) as s:
        with pytest.raises(NotFound, match="did you mean CartPole-v1") as err:
            await s.create("CartPole-v9", 2)
        assert err.value.field == "create.env_id"
        await s.create("CartPole-v1", 4)  # the same stream creates fine afterwards
        await s.reset()
        await assert_still_serving(s)


async def test_env_spaces_reads_one_env_and_frees_its_session(address: str) -> None:
    await wait_active(0)
    observation, action = await env_spaces(address, "CartPole-v1")
    local = gym.make("CartPole-v1")
    assert (observation, action) == (local.observation_space, local.action_space)
    await wait_active(0)  # closed at once: no slot left taken
    kwargs = {"use_lidar": False}
    flappy = await env_spaces(address, "FlappyBird-v0", kwargs)
    assert flappy[0] == gym.make("FlappyBird-v0", **kwargs).observation_space
    with pytest.raises(NotFound, match="did you mean CartPole-v1"):
        await env_spaces(address, "CartPole-v9")
    # What a learner waiting for its env servers retries on: a server that is not up yet.
    with pytest.raises(Unavailable):
        await env_spaces(f"127.0.0.1:{free_port()}", "CartPole-v1", timeout_s=10)
    await wait_active(0)


async def test_num_envs_over_the_limit(address: str) -> None:
    async with session(address) as s:
        with pytest.raises(ResourceExhausted, match="max_envs_per_session=32") as err:
            await s.create("CartPole-v1", MAX_ENVS + 1)
        assert err.value.field == "create.num_envs"
        with pytest.raises(InvalidArgument, match="num_envs must be >= 1"):
            await s.create("CartPole-v1", 0)
        await s.create("CartPole-v1", MAX_ENVS)
        await s.reset()
        await assert_still_serving(s, MAX_ENVS)


async def test_sessions_over_the_limit_while_others_keep_working(address: str) -> None:
    await wait_active(0)
    holders = [await cartpole(address) for _ in range(MAX_SESSIONS)]
    assert active_sessions() == MAX_SESSIONS
    extra = EnvSession(address)
    try:
        with pytest.raises(ResourceExhausted, match="max_sessions=3"):
            await extra.create("CartPole-v1", 1)
        for s in holders:
            await assert_still_serving(s)
        await holders.pop().close()
        await wait_active(MAX_SESSIONS - 1)
        await extra.create("CartPole-v1", 1)  # the refused stream may retry
        assert active_sessions() == MAX_SESSIONS
    finally:
        for s in [*holders, extra]:
            await s.close()
    await wait_active(0)


async def test_client_disappearing_frees_the_session(address: str) -> None:
    await wait_active(0)
    s = await cartpole(address, 8)
    await assert_still_serving(s, 8)
    assert active_sessions() == 1
    s.abort()  # cancel the call without a CloseRequest: the client is gone
    await wait_active(0)
    await s.close()


async def test_close_reports_total_steps_and_frees_the_session(address: str) -> None:
    await wait_active(0)
    s = await cartpole(address, 4)
    for _ in range(3):
        await assert_still_serving(s)
    assert await s.close() == 12
    await wait_active(0)


async def test_env_raising_is_internal_and_the_stream_continues(address: str) -> None:
    async with session(address) as s:
        await s.create(RAISING_ID, 2)
        await s.reset()
        with pytest.raises(RlfleetError, match="ZeroDivisionError: the env divided by zero") as err:
            await s.step(np.array([0, 1]))
        assert err.value.code == grpc.StatusCode.INTERNAL
        with pytest.raises(FailedPrecondition, match="step before reset"):
            await s.step(np.zeros(2, np.int64))  # half-stepped pool: must be reset first
        await s.reset()
        result = await s.step(np.zeros(2, np.int64))
        assert result.rewards.tolist() == [1.0, 1.0]


async def test_disabled_autoreset_requires_reset_of_ended_envs(address: str) -> None:
    async with session(address) as s:
        await s.create("CartPole-v1", 2, autoreset_mode="Disabled")
        await s.reset(seed=0)
        ended = np.zeros(2, bool)
        while not ended.any():
            r = await s.step(np.ones(2, np.int64))
            ended = r.terminated | r.truncated
            assert r.final_observations is None
        with pytest.raises(FailedPrecondition, match="reset them before stepping"):
            await s.step(np.ones(2, np.int64))
        obs, _ = await s.reset(env_indices=np.flatnonzero(ended).tolist())
        assert obs.shape == (2, 4)
        await s.step(np.ones(2, np.int64))
        with pytest.raises(InvalidArgument, match=r"env indices \[5\] out of range"):
            await s.reset(env_indices=[5])


async def test_render_frames(address: str) -> None:
    async with session(address) as s:
        await s.create("CartPole-v1", 2, render_mode="rgb_array")
        await s.reset(seed=0)
        frames = await s.render([1, 0])
        assert frames.shape == (2, 400, 600, 3) and frames.dtype == np.uint8
    async with session(address) as s:
        await s.create("CartPole-v1", 1)
        await s.reset()
        with pytest.raises(FailedPrecondition, match="render_mode 'rgb_array'"):
            await s.render()


@pytest.mark.filterwarnings("ignore:.*is not within the observation space")  # flappy's own
async def test_flappy_bird_creates_and_steps(address: str) -> None:
    async with session(address) as s:
        info = await s.create("FlappyBird-v0", 2, seed=0)
        assert info.action_space == gym.spaces.Discrete(2)
        obs, infos = await s.reset()
        assert obs.shape == (2, *info.observation_space.shape)
        assert infos["_score"].tolist() == [True, True]  # numeric infos travel, vector style
        for _ in range(5):
            result = await s.step(np.zeros(2, np.int64))
        assert result.observations.shape == obs.shape


async def test_raw_protocol_echoes_ids_and_reports_codes_in_band(address: str) -> None:
    """The wire itself: one answer per request with its request_id, errors as google.rpc.Status."""
    async with channel(address) as ch:
        call = env_pb2_grpc.EnvServiceStub(ch).Session()
        requests = [
            env_pb2.SessionRequest(request_id=11),  # empty
            env_pb2.SessionRequest(request_id=12, step=env_pb2.StepRequest()),
            env_pb2.SessionRequest(
                request_id=13, create=env_pb2.CreateRequest(env_id="CartPole-v1", num_envs=2)
            ),
            env_pb2.SessionRequest(request_id=14, reset=env_pb2.ResetRequest(seed=5)),
            env_pb2.SessionRequest(
                request_id=15,
                step=env_pb2.StepRequest(actions=tensor.encode_tree(np.zeros((2, 2), np.int64))),
            ),
            env_pb2.SessionRequest(request_id=16, close=env_pb2.CloseRequest()),
        ]
        for r in requests:
            await call.write(r)
        await call.done_writing()
        answers = [a async for a in call]
        assert [a.request_id for a in answers] == [11, 12, 13, 14, 15, 16]
        codes = [a.error.code for a in answers]
        assert codes == [
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            grpc.StatusCode.FAILED_PRECONDITION.value[0],
            0,
            0,
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            0,
        ]
        bad = error_details_pb2.BadRequest()
        assert any(d.Unpack(bad) for d in answers[4].error.details)
        assert bad.field_violations[0].field == "actions"
        assert answers[2].create.autoreset_mode == env_pb2.AUTORESET_MODE_SAME_STEP
        assert answers[3].reset.observations.tensor.shape == [2, 4]
        assert answers[5].close.total_steps == 0
        assert await call.code() == grpc.StatusCode.OK


async def test_nested_spaces_travel_both_ways(address: str) -> None:
    async with session(address) as s:
        info = await s.create(NESTED_ID, 2)
        assert info.observation_space == NestedEnv.observation_space
        assert info.action_space == NestedEnv.action_space
        obs, _ = await s.reset(seed=0)
        assert obs["name"] == ["a", "a"] and obs["pos"].shape == (2, 2)
        moves = np.array([[0.5, -0.5], [0.25, 1.0]], np.float32)
        result = await s.step((np.array([1, 2]), moves))
        np.testing.assert_array_equal(result.observations["pos"], moves)
        assert result.observations["last"].tolist() == [1, 2]
        assert result.observations["name"] == ["ab", "abab"]
        assert result.infos["t"].tolist() == [1, 1] and result.infos["_t"].all()
        with pytest.raises(InvalidArgument, match="value 3 is outside") as err:
            await s.step((np.array([3, 0]), moves))
        assert err.value.field == "actions[0]"
        await s.step((np.array([0, 0]), moves))
        result = await s.step((np.array([2, 1]), moves))  # third step: both truncate
        assert result.truncated.all() and result.final_observations["name"] == ["abab", "ab"]
        assert result.observations["name"] == ["a", "a"]  # autoreset, same step
        assert result.infos["_final_info"].all() and result.infos["final_info"]["t"].tolist() == [
            3,
            3,
        ]


async def test_remote_vector_env_final_obs_rows_for_nested_spaces(address: str) -> None:
    """RemoteVectorEnv (sync, on its own loop) in a worker thread while this loop serves."""

    def run() -> dict:
        envs = RemoteVectorEnv(address, NESTED_ID, 2, autoreset_mode="SameStep")
        try:
            envs.reset(seed=0)
            moves = np.zeros((2, 2), np.float32)
            for _ in range(3):
                *_, infos = envs.step((np.array([1, 2]), moves))
            return infos
        finally:
            envs.close()

    infos = await asyncio.to_thread(run)
    assert infos["_final_obs"].tolist() == [True, True]
    first = infos["final_obs"][0]
    assert first["name"] == "ab" and first["last"] == 1
    np.testing.assert_array_equal(first["pos"], np.zeros(2, np.float32))
    assert infos["final_info"]["t"].tolist() == [3, 3]


async def test_server_shutdown_ends_sessions_with_unavailable() -> None:
    """A fatal end of the stream is a gRPC status; the session stays ended afterwards."""
    service = EnvService(name="env-shutdown")
    server = GrpcServer("env-shutdown", grace_s=0.2)
    server.add_service(env_pb2_grpc.add_EnvServiceServicer_to_server, service, SERVICE_NAME)
    port = await server.start()
    s = EnvSession(f"127.0.0.1:{port}", request_timeout_s=30)
    try:
        await s.create("CartPole-v1", 2)
        await s.reset()
        await server.stop()
        async with asyncio.timeout(10):  # the pool is closed on the way out
            while service.active_sessions:
                await asyncio.sleep(0.01)
        with pytest.raises(Unavailable):
            await s.step(np.zeros(2, np.int64))
        with pytest.raises(Unavailable):  # no silent new stream without a pool
            await s.step(np.zeros(2, np.int64))
    finally:
        assert await s.close() == 0
        await s.close()  # idempotent


# --------------------------------------------------------------------------- bounded inputs

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def violated_field(status) -> str:
    bad = error_details_pb2.BadRequest()
    for detail in status.details:
        if detail.Unpack(bad):
            return bad.field_violations[0].field
    return ""


async def exchange(
    address: str, requests: list[env_pb2.SessionRequest]
) -> list[env_pb2.SessionResponse]:
    """Send each request on one raw stream, reading its answer before the next; then close."""
    async with channel(address) as ch:
        call = env_pb2_grpc.EnvServiceStub(ch).Session()
        answers = []
        for i, request in enumerate(requests, 1):
            request.request_id = i
            await call.write(request)
            answers.append(await call.read())
        await call.done_writing()
        assert [a.request_id for a in answers] == list(range(1, len(requests) + 1))
        assert await call.code() == grpc.StatusCode.OK
        return answers


def create(**kwargs) -> env_pb2.SessionRequest:
    kwargs.setdefault("env_id", "CartPole-v1")
    kwargs.setdefault("num_envs", 2)
    request = env_pb2.SessionRequest(create=env_pb2.CreateRequest(**kwargs))
    return request


def reset(**kwargs) -> env_pb2.SessionRequest:
    return env_pb2.SessionRequest(reset=env_pb2.ResetRequest(**kwargs))


def with_struct(request: env_pb2.SessionRequest, field: str, value: dict) -> env_pb2.SessionRequest:
    kind = request.WhichOneof("request")
    getattr(getattr(request, kind), field).update(value)
    return request


def step(actions: np.ndarray) -> env_pb2.SessionRequest:
    return env_pb2.SessionRequest(step=env_pb2.StepRequest(actions=tensor.encode_tree(actions)))


async def test_bad_create_requests_are_invalid_argument_naming_the_field(address: str) -> None:
    """Each used to be accepted, or INTERNAL ("KeyError: 77", "ValueError: ... Infinity")."""
    bad = [
        (create(autoreset_mode=77), "create.autoreset_mode"),
        (create(seed=-1), "create.seed"),
        (create(render_mode="human3d"), "create.render_mode"),
        (create(render_mode="human"), "create.render_mode"),
        (with_struct(create(), "kwargs", {"x": float("nan")}), "create.kwargs.x"),
        (
            with_struct(create(), "kwargs", {"a": {"b": [1.0, float("inf")]}}),
            "create.kwargs.a.b[1]",
        ),
        (with_struct(create(), "kwargs", {"render_mode": "human"}), "create.kwargs.render_mode"),
    ]
    answers = await exchange(address, [r for r, _ in bad] + [create(seed=3), reset()])
    for (request, field), answer in zip(bad, answers, strict=False):
        assert answer.error.code == INVALID, request
        assert violated_field(answer.error) == field, answer.error.message
        assert not answer.HasField("create")
    assert answers[-2].error.code == 0 and answers[-2].create.num_envs == 2  # still serving
    assert answers[-1].error.code == 0 and answers[-1].reset.observations.tensor.shape == [2, 4]
    await wait_active(0)


async def test_kwargs_the_env_rejects_are_invalid_argument_naming_them(address: str) -> None:
    """The env's own constructor refusing the client's kwargs used to be INTERNAL ("ValueError:
    Expect the `max_episode_steps` to be positive")."""
    bad = [
        ("CartPole-v1", {"max_episode_steps": -5}, "max_episode_steps=-5"),
        ("Snake-v0", {"size": 640}, "size=640"),
    ]
    requests = [with_struct(create(env_id=env_id), "kwargs", kw) for env_id, kw, _ in bad]
    answers = await exchange(address, [*requests, create(), reset()])
    for (env_id, kwargs, shown), answer in zip(bad, answers, strict=False):
        assert answer.error.code == INVALID, answer.error.message
        assert violated_field(answer.error) == f"create.kwargs.{next(iter(kwargs))}"
        assert answer.error.message.startswith(f"{env_id}: argument {shown} rejected: ValueError")
    assert answers[-1].error.code == 0  # still serving
    async with session(address) as s:
        with pytest.raises(InvalidArgument, match=r"Snake-v0: argument size=640 rejected"):
            await s.create("Snake-v0", 1, kwargs={"size": 640})
    await wait_active(0)


async def test_bad_resets_are_invalid_argument_and_the_pool_keeps_serving(address: str) -> None:
    bad = [
        (reset(seed=-1), "reset.seed"),
        (with_struct(reset(), "options", {"low": float("nan")}), "reset.options.low"),
        (with_struct(reset(), "options", {"low": "x"}), "reset.options"),  # CartPole: ValueError
        (with_struct(reset(), "options", {"low": 1, "high": 0}), "reset.options"),
        (reset(env_indices=[0, 0]), "reset.env_indices"),
        (reset(env_indices=[0, 1, 0]), "reset.env_indices"),
        (reset(env_indices=[2]), "reset.env_indices"),
    ]
    requests = [create(seed=0), reset(seed=0)] + [r for r, _ in bad]
    # An env that raised on its options may be half reset: the pool wants a full reset again.
    requests += [reset(seed=1), reset(env_indices=[1]), step(np.zeros(2, np.int64))]
    answers = await exchange(address, requests)
    for (request, field), answer in zip(bad, answers[2:], strict=False):
        assert answer.error.code == INVALID, request
        assert violated_field(answer.error) == field, answer.error.message
    assert answers[-3].error.code == 0 and answers[-2].error.code == 0
    assert answers[-2].reset.observations.tensor.shape == [2, 4]
    assert answers[-1].error.code == 0 and answers[-1].step.rewards.shape == [2]


async def test_huge_duplicate_env_indices_are_rejected_before_any_work(address: str) -> None:
    """300,000 copies of index 0 used to reset env 0 300,000 times (2.9 s, loop blocked)."""
    many = reset(env_indices=[0] * 300_000)
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await exchange(address, [create(), reset(), many, step(np.zeros(2, np.int64))])
    assert loop.time() - started < 2.0
    assert answers[2].error.code == INVALID
    assert violated_field(answers[2].error) == "reset.env_indices"
    assert "300000 env indices for a pool of 2" in answers[2].error.message
    assert answers[3].error.code == 0  # still serving


async def test_overflowing_action_shape_is_invalid_argument(address: str) -> None:
    actions = tensor_pb2_tree([0, 2**62, 2**62])
    answers = await exchange(address, [create(), reset(), actions, step(np.zeros(2, np.int64))])
    assert answers[2].error.code == INVALID  # was INTERNAL ("ValueError: array is too big")
    assert "too large" in answers[2].error.message
    assert answers[3].error.code == 0


def tensor_pb2_tree(shape: list[int]) -> env_pb2.SessionRequest:
    request = step(np.zeros(2, np.int64))
    request.step.actions.tensor.ClearField("shape")
    request.step.actions.tensor.shape.extend(shape)
    request.step.actions.tensor.data = b""
    return request


async def test_render_rejects_duplicates(address: str) -> None:
    """120 copies of one index used to build 86 MB and kill the stream (message too large)."""
    render = env_pb2.SessionRequest(render=env_pb2.RenderRequest(env_indices=[0] * 120))
    again = env_pb2.SessionRequest(render=env_pb2.RenderRequest(env_indices=[1, 0]))
    answers = await exchange(address, [create(render_mode="rgb_array"), reset(), render, again])
    assert answers[2].error.code == INVALID
    assert violated_field(answers[2].error) == "render.env_indices"
    assert answers[3].error.code == 0 and list(answers[3].render.frames.shape) == [2, 400, 600, 3]


@contextlib.asynccontextmanager
async def env_server(name: str, **settings) -> AsyncIterator[str]:
    """One more env server (service.main) with its own settings."""
    ctx = ServiceContext(
        name=name, kind="env_server", settings=EnvServerSettings(**settings), port=free_port()
    )
    serving = asyncio.create_task(main(ctx))
    address = f"127.0.0.1:{ctx.port}"
    try:
        async with channel(address) as ch:
            stub = env_pb2_grpc.EnvServiceStub(ch)
            await stub.ListEnvs(
                env_pb2.ListEnvsRequest(filter="x"), wait_for_ready=True, timeout=30
            )
        yield address
    finally:
        ctx.stop_event.set()
        await asyncio.wait_for(serving, 30)


async def test_render_over_the_message_limit_is_resource_exhausted_in_band() -> None:
    # Two CartPole frames are 1.44 MB, over a 1 MiB server limit; one (720 KB) fits.
    async with env_server("env-render-limit", max_message_bytes=1 << 20) as address:
        answers = await exchange(
            address,
            [
                create(render_mode="rgb_array"),
                reset(),
                env_pb2.SessionRequest(render=env_pb2.RenderRequest(env_indices=[0, 1])),
                env_pb2.SessionRequest(render=env_pb2.RenderRequest(env_indices=[1])),
            ],
        )
    assert answers[2].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert violated_field(answers[2].error) == "render.env_indices"
    assert "render fewer envs" in answers[2].error.message
    assert answers[3].error.code == 0 and list(answers[3].render.frames.shape) == [1, 400, 600, 3]


async def test_idle_sessions_are_ended_with_unavailable_and_free_their_slot() -> None:
    name = "env-idle"

    def active() -> float:
        return REGISTRY.get_sample_value("rlfleet_env_sessions_active", {"server": name}) or 0.0

    async with env_server(name, max_sessions=1, session_idle_timeout_s=0.3) as address:
        idle = await cartpole(address, 2)
        try:
            assert active() == 1
            async with asyncio.timeout(10):
                while active():  # freed by the server, without any word from the client
                    await asyncio.sleep(0.02)
            with pytest.raises(Unavailable, match="session_idle_timeout_s") as err:
                await idle.step(np.zeros(2, np.int64))
            assert "no request for 0.3s" in str(err.value)
        finally:
            await idle.close()
        busy = await cartpole(address, 2)  # the slot is free again; a busy session lives on
        try:
            for _ in range(4):
                await asyncio.sleep(0.15)
                await assert_still_serving(busy, 2)
        finally:
            await busy.close()
        async with channel(address) as ch:  # raw: the stream ends with the status
            call = env_pb2_grpc.EnvServiceStub(ch).Session()
            await call.write(create())
            assert (await call.read()).error.code == 0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "session_idle_timeout_s" in (info.value.details() or "")


async def test_float64_rewards_render_metadata_and_per_env_seeds(address: str) -> None:
    """CreateRequest.float64_rewards, CreateResponse.render_modes/render_fps, ResetRequest.seeds."""
    local = gym.make("Pendulum-v1")
    async with session(address) as s:
        info = await s.create("Pendulum-v1", 3, float64_rewards=True)
        assert info.render_modes == ("rgb_array",) and info.render_fps == 30
        obs, _ = await s.reset(seed=[4, None, 9])
        np.testing.assert_array_equal(obs[2], local.reset(seed=9)[0])
        np.testing.assert_array_equal(obs[0], local.reset(seed=4)[0])
        result = await s.step(np.full((3, 1), 0.5, np.float32))
        want = local.step(np.array([0.5], np.float32))[1]
        assert result.rewards.dtype == np.float64 and result.rewards[0] == want
        with pytest.raises(InvalidArgument, match="2 seeds for 3 environments") as err:
            await s.reset(seed=[1, 2])
        assert err.value.field == "reset.seeds"
        obs, _ = await s.reset(seed=[7], env_indices=[1])
        np.testing.assert_array_equal(obs[1], local.reset(seed=7)[0])
    async with session(address) as s:
        await s.create("Pendulum-v1", 2)
        await s.reset(seed=0)
        assert (await s.step(np.zeros((2, 1), np.float32))).rewards.dtype == np.float32


# ---------------------------------------------------------------------- non-finite observations


async def test_nan_observation_from_the_env_is_refused_in_band_naming_env_and_field(
    address: str,
) -> None:
    answers = await exchange(
        address,
        [
            create(env_id=NAN_ID, num_envs=3),
            reset(),
            step(np.array([0, 1, 0])),
            step(np.array([0, 0, 0])),
            reset(),
            step(np.array([0, 0, 0])),
        ],
    )
    refused = answers[2].error
    assert refused.code == INVALID and answers[2].WhichOneof("result") is None
    assert violated_field(refused) == "step.observations"
    assert "env 1 (row 1): nan at [2] is not finite" in refused.message
    # As after an env raising: the pool stepped, so it must be reset before the next step.
    assert answers[3].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert answers[5].error.code == 0
    assert tensor.decode_tree(answers[5].step.observations).tolist() == [[0.0] * 3] * 3
    async with session(address) as s:  # the client's error: the env's fault, not the actions'
        await s.create(NAN_ID, 2)
        await s.reset()
        with pytest.raises(InvalidArgument, match=r"env 0 \(row 0\): inf at \[0\]") as err:
            await s.step(np.array([2, 0]))
        assert type(err.value) is InvalidArgument and err.value.field == "step.observations"


async def test_nonfinite_observations_clip_setting_replaces_them() -> None:
    register_test_envs()
    async with (
        env_server("env-clip", nonfinite_observations="clip") as address,
        session(address) as s,
    ):
        await s.create(NAN_ID, 3)
        await s.reset()
        result = await s.step(np.array([2, 1, 0]))
    # inf becomes the space's high bound, NaN becomes 0.
    assert result.observations.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert result.rewards.tolist() == [1.0, 1.0, 1.0]
