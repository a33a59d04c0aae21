"""Property-based fuzzing of every request type the env server and reward service take.

Requests are drawn from the proto descriptors (tests/fuzz/proto_strategies.py): wholly random
messages, valid requests with one field mutated anywhere inside them, random stream sequences,
and raw bytes that are not a valid protobuf at all. The property: a service answers every one of
them in-band or with a gRPC code, never INTERNAL or UNKNOWN (a bug on its side) and never by
hanging past the deadline; and it keeps serving (alive, health SERVING, a valid request still
answered correctly). The language-model sampler and the weight service are fuzzed the same way
in test_grpc_fuzz_lm.py, against the session's shared vLLM stack.

The number of requests tried and the codes they got are printed at the end of the module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import code_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.common.v1 import tensor_pb2
from rlfleet.env.v1 import env_pb2, env_pb2_grpc
from rlfleet.reward.v1 import reward_pb2, reward_pb2_grpc
from tests.fuzz.proto_strategies import messages, mutations
from tests.fuzz.servers import Served, serve

pytestmark = pytest.mark.slow

BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
IN_BAND_BUGS = {code_pb2.INTERNAL, code_pb2.UNKNOWN}
DEADLINE_S = 20.0
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
TRIED: Counter[str] = Counter()  # "<method> <code>" -> count


def record(method: str, code: object) -> None:
    name = getattr(code, "name", None) or code_pb2.Code.Name(int(code))  # type: ignore[call-overload]
    TRIED[f"{method} {name}"] += 1


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    total = sum(TRIED.values())
    lines = [f"fuzz: {total} bad or random requests tried"]
    lines += [f"  {key}: {n}" for key, n in sorted(TRIED.items())]
    print("\n".join(lines))


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("fuzz-env")
    settings_ = {"preload": ["CartPole-v1"], "max_sessions": 16, "max_envs_per_session": 64}
    with serve("env_server", settings_, tmp) as served:
        yield served


@pytest.fixture(scope="module")
def reward_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("fuzz-reward")
    settings_ = {"rewards": {"accuracy": 1.0, "format": 0.5}, "max_items_per_request": 16}
    with serve("reward_service", settings_, tmp) as served:
        yield served


def call_unary(served: Served, method: str, request: bytes) -> None:
    """Send serialized `request` to unary `method`; fail on a bug code."""
    rpc = served.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        rpc(request, timeout=DEADLINE_S)
        record(method, grpc.StatusCode.OK)
    except grpc.RpcError as err:
        record(method, err.code())
        assert err.code() not in BUGS, f"{method}: {err.code()} {err.details()}"


# ---- EnvService ---------------------------------------------------------------------------

CREATE = env_pb2.SessionRequest(
    request_id=1, create=env_pb2.CreateRequest(env_id="CartPole-v1", num_envs=3, seed=1)
)
RESET = env_pb2.SessionRequest(request_id=2, reset=env_pb2.ResetRequest(seed=5))
STEP = env_pb2.SessionRequest(request_id=3)
STEP.step.actions.tensor.CopyFrom(
    tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_INT64, shape=[3], data=bytes(24))
)
RENDER = env_pb2.SessionRequest(request_id=4, render=env_pb2.RenderRequest(env_indices=[0]))
ANY_SESSION_REQUEST = st.one_of(
    messages(env_pb2.SessionRequest.DESCRIPTOR),
    mutations(STEP),
    mutations(RESET),
    mutations(RENDER),
    mutations(CREATE),
)


@st.composite
def session_streams(draw: st.DrawFn) -> list[env_pb2.SessionRequest]:
    """A stream: most of the time a valid create and reset first, so later requests get past
    the session checks, then a few random or mutated requests."""
    prefix = [CREATE, RESET] if draw(st.integers(0, 3)) else []
    if prefix and draw(st.booleans()):
        prefix = [draw(mutations(CREATE)), RESET]
    return prefix + draw(st.lists(ANY_SESSION_REQUEST, min_size=1, max_size=5))


def run_session(served: Served, requests: list[env_pb2.SessionRequest]) -> None:
    stub = env_pb2_grpc.EnvServiceStub(served.channel)
    answered = 0
    try:
        for response in stub.Session(iter(requests), timeout=DEADLINE_S):
            answered += 1
            code = response.error.code
            record("EnvService/Session", code)
            assert code not in IN_BAND_BUGS, f"in-band {code}: {response.error.message}"
        # Every request is answered, in order; a Close ends the stream after its answer.
        closes = [i for i, r in enumerate(requests) if r.WhichOneof("request") == "close"]
        expected = closes[0] + 1 if closes else len(requests)
        assert answered >= expected, f"answered {answered} of {len(requests)}"
    except grpc.RpcError as err:
        record("EnvService/Session", err.code())
        assert err.code() not in BUGS, f"Session ended {err.code()}: {err.details()}"


@settings(FUZZ, max_examples=300)
@given(requests=session_streams())
def test_env_session_streams(env_server: Served, requests: list[env_pb2.SessionRequest]) -> None:
    run_session(env_server, requests)


@FUZZ
@given(request=messages(env_pb2.ListEnvsRequest.DESCRIPTOR))
def test_list_envs(env_server: Served, request: env_pb2.ListEnvsRequest) -> None:
    call_unary(env_server, "/rlfleet.env.v1.EnvService/ListEnvs", request.SerializeToString())


def test_env_server_still_serves_after_the_fuzz(env_server: Served) -> None:
    env_server.assert_serving()
    stub = env_pb2_grpc.EnvServiceStub(env_server.channel)
    responses = list(stub.Session(iter([CREATE, RESET, STEP]), timeout=DEADLINE_S))
    assert [r.error.code for r in responses] == [0, 0, 0]
    assert responses[2].step.observations.tensor.shape == [3, 4]


# ---- RewardService ------------------------------------------------------------------------

SCORE = reward_pb2.ScoreRequest(
    items=[reward_pb2.ScoreItem(prompt="6*7?", completion="<answer>42</answer>")],
    rewards=[reward_pb2.RewardWeight(name="accuracy", weight=1.0)],
)
SCORE.items[0].extra.update({"answer": "42"})


@FUZZ
@given(request=st.one_of(messages(reward_pb2.ScoreRequest.DESCRIPTOR), mutations(SCORE)))
def test_score(reward_service: Served, request: reward_pb2.ScoreRequest) -> None:
    call_unary(reward_service, "/rlfleet.reward.v1.RewardService/Score",
               request.SerializeToString())  # fmt: skip


@FUZZ
@given(request=messages(reward_pb2.ListRewardsRequest.DESCRIPTOR))
def test_list_rewards(reward_service: Served, request: reward_pb2.ListRewardsRequest) -> None:
    call_unary(reward_service, "/rlfleet.reward.v1.RewardService/ListRewards",
               request.SerializeToString())  # fmt: skip


def test_reward_service_still_serves_after_the_fuzz(reward_service: Served) -> None:
    reward_service.assert_serving()
    stub = reward_pb2_grpc.RewardServiceStub(reward_service.channel)
    result = stub.Score(SCORE, timeout=DEADLINE_S).results[0]
    assert result.total == pytest.approx(1.0)


# ---- Bytes that are no protobuf at all ----------------------------------------------------

UNARY = {
    "env_server": ["/rlfleet.env.v1.EnvService/ListEnvs"],
    "reward_service": ["/rlfleet.reward.v1.RewardService/Score",
                       "/rlfleet.reward.v1.RewardService/ListRewards"],
}  # fmt: skip


@FUZZ
@given(data=st.binary(min_size=1, max_size=64), which=st.integers(0, 2))
def test_undecodable_requests(
    env_server: Served, reward_service: Served, data: bytes, which: int
) -> None:
    served, method = [
        (env_server, UNARY["env_server"][0]),
        (reward_service, UNARY["reward_service"][0]),
        (reward_service, UNARY["reward_service"][1]),
    ][which]
    call_unary(served, method, data)


def test_undecodable_stream_message(env_server: Served, tmp_path: Path) -> None:
    rpc = env_server.channel.stream_stream(
        "/rlfleet.env.v1.EnvService/Session", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as err:
        list(rpc(iter([b"\xff\xff\xff"]), timeout=DEADLINE_S))
    record("EnvService/Session", err.value.code())
    assert err.value.code() not in BUGS, err.value.details()
    env_server.assert_serving()
