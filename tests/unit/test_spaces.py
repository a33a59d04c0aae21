"""common.spaces: every space type survives the wire, and every bad action is named."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from common import spaces as wire
from common import tensor
from rlfleet.common.v1 import space_pb2, tensor_pb2
from services.errors import InvalidArgument

BOX = spaces.Box(low=-1.0, high=np.array([1.0, 2.0, np.inf], np.float32), dtype=np.float32)
IMAGE = spaces.Box(0, 255, shape=(4, 5, 3), dtype=np.uint8)
NESTED = spaces.Dict(
    {
        "pos": spaces.Tuple([BOX, spaces.Discrete(3, start=-1)]),
        "keys": spaces.MultiBinary([2, 3]),
        "inner": spaces.Dict(
            {"md": spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[0, 1], [2, 3]])}
        ),
        "say": spaces.Text(5, min_length=1, charset="abc"),
    }
)

ROUND_TRIP = [
    BOX,
    IMAGE,
    spaces.Box(-2, 7, shape=(2,), dtype=np.int32),
    spaces.Box(-np.inf, np.inf, shape=(), dtype=np.float64),
    spaces.Discrete(5),
    spaces.Discrete(4, start=10, dtype=np.int32),
    spaces.MultiDiscrete([3, 4, 5]),
    spaces.MultiDiscrete(np.array([[2, 3]]), dtype=np.int32, start=[[1, -1]]),
    spaces.MultiBinary(6),
    spaces.MultiBinary([2, 3]),
    spaces.Text(12),
    spaces.Text(8, min_length=2, charset="xyz01"),
    spaces.Tuple([spaces.Discrete(2), spaces.Tuple([BOX, spaces.Text(3)])]),
    NESTED,
]


@pytest.mark.parametrize("space", ROUND_TRIP, ids=repr)
def test_round_trip(space: gym.Space) -> None:
    msg = wire.to_proto(space)
    again = wire.from_proto(space_pb2.Space.FromString(msg.SerializeToString()))
    assert again == space
    if isinstance(space, spaces.Dict):
        assert list(again.spaces) == list(space.spaces)  # key order is kept


def test_default_charset_travels_as_empty() -> None:
    assert wire.to_proto(spaces.Text(4)).text.charset == ""


def test_unsupported_and_empty_spaces() -> None:
    with pytest.raises(InvalidArgument, match="Graph"):
        wire.to_proto(spaces.Graph(spaces.Box(0, 1, (2,)), None))
    with pytest.raises(InvalidArgument, match="empty Space"):
        wire.from_proto(space_pb2.Space())


def test_batch_specs_nested() -> None:
    specs = wire.batch_specs(NESTED, 8)
    assert specs["pos"][0] == tensor.spec("actions.pos[0]", np.float32, [8, 3])
    assert specs["pos"][1] == tensor.spec("actions.pos[1]", np.int64, [8])
    assert specs["keys"] == tensor.spec("actions.keys", np.int8, [8, 2, 3])
    assert specs["inner"]["md"] == tensor.spec("actions.inner.md", np.int64, [8, 2, 2])
    assert specs["say"] == tensor_pb2.TensorSpec(name="actions.say", shape=[8])


def test_batch_spec_leaf_matches_a_sampled_batch() -> None:
    spec = wire.batch_specs(IMAGE, 4)
    batch = np.stack([IMAGE.sample() for _ in range(4)])
    tensor.check(batch, spec)


def _sample(space: gym.Space, n: int) -> object:
    space.seed(0)
    from gymnasium.vector.utils import batch_space

    return batch_space(space, n).sample()


@pytest.mark.parametrize("space", ROUND_TRIP, ids=repr)
def test_valid_batches_pass(space: gym.Space) -> None:
    batch = _sample(space, 3)
    if isinstance(space, spaces.Text):
        batch = list(batch)
    if isinstance(space, spaces.Tuple) and isinstance(space.spaces[1], spaces.Tuple):
        batch = (batch[0], (batch[1][0], list(batch[1][1])))
    if isinstance(space, spaces.Dict):
        batch = {**batch, "say": list(batch["say"])}
    out = wire.validate_actions(space, batch, 3)
    assert type(out) is type(batch)


def _raises(space: gym.Space, actions: object, n: int, match: str, field: str = "actions") -> None:
    with pytest.raises(InvalidArgument, match=match) as info:
        wire.validate_actions(space, actions, n)
    assert info.value.field == field


def test_discrete_accepts_other_int_dtypes_and_casts() -> None:
    out = wire.validate_actions(spaces.Discrete(3), np.array([0, 2], np.uint8), 2)
    assert out.dtype == np.int64
    assert out.tolist() == [0, 2]
    out = wire.validate_actions(spaces.MultiDiscrete([3, 3]), np.ones((2, 2), np.int16), 2)
    assert out.dtype == np.int64


def test_wrong_shape() -> None:
    _raises(spaces.Discrete(2), np.zeros(3, np.int64), 2, r"expected shape \[2\], got \[3\]")
    _raises(BOX, np.zeros((2, 2), np.float32), 2, r"expected shape \[2, 3\], got \[2, 2\]")


def test_wrong_dtype() -> None:
    _raises(spaces.Discrete(2), np.zeros(2, np.float32), 2, "expected an integer dtype")
    _raises(spaces.Discrete(2), np.zeros(2, bool), 2, "expected an integer dtype")
    _raises(IMAGE, np.zeros((1, 4, 5, 3), np.int64), 1, "expected dtype uint8, got int64")
    _raises(spaces.MultiBinary(2), np.zeros((1, 2), np.int64), 1, "expected dtype int8")
    # float16 is not float64: only the float64 -> float32 convenience exists
    _raises(BOX, np.zeros((1, 3), np.float16), 1, "expected dtype float32, got float16")


def test_float64_accepted_for_float32_box() -> None:
    out = wire.validate_actions(BOX, np.full((2, 3), 0.5), 2)
    assert out.dtype == np.float32


def test_out_of_range_discrete_names_env_and_value() -> None:
    space = spaces.Discrete(3, start=-1)
    _raises(space, np.array([0, 1, 2], np.int64), 3, r"env 2: value 2 is outside \[-1, 1\]")
    _raises(space, np.array([-2, 0], np.int32), 2, r"env 0: value -2 is outside \[-1, 1\]")
    md = spaces.MultiDiscrete([2, 5])
    _raises(md, np.array([[1, 4], [1, 5]]), 2, r"env 1: value 5 at \[1\] is outside \[0, 4\]")
    _raises(spaces.MultiBinary(2), np.array([[0, 1], [2, 0]], np.int8), 2, "env 1: value 2")


def test_nan_and_inf_in_continuous_actions_name_env() -> None:
    _raises(BOX, np.array([[0, 0, 0], [0, np.nan, 0]], np.float32), 2, "env 1: .*NaN")
    _raises(BOX, np.array([[np.inf, 0, 0]]), 1, "env 0: .*inf")


def test_integer_box_bounds() -> None:
    space = spaces.Box(-2, 7, shape=(2,), dtype=np.int32)
    _raises(space, np.array([[0, 8]], np.int32), 1, r"env 0: value 8 at \[1\] is outside \[-2, 7\]")


def test_nested_errors_name_the_path() -> None:
    good = _sample(NESTED, 2)
    good = {**good, "say": list(good["say"])}
    bad = {**good, "pos": (good["pos"][0], np.array([0, 5]))}
    _raises(NESTED, bad, 2, "env 1: value 5", field="actions.pos[1]")
    _raises(NESTED, {"pos": good["pos"]}, 2, "expected a dict with keys")
    bad = {**good, "pos": (good["pos"][0],)}
    _raises(NESTED, bad, 2, "expected a tuple of 2 items", field="actions.pos")
    bad = {**good, "inner": {"md": good["inner"]["md"][:1]}}
    _raises(NESTED, bad, 2, "expected shape", field="actions.inner.md")


def test_text_errors() -> None:
    space = spaces.Text(3, min_length=1, charset="ab")
    _raises(space, ["a"], 2, "expected 2 strings, got 1 strings")
    _raises(space, ["ab", "abab"], 2, r"env 1: length 4 is outside \[1, 3\]")
    _raises(space, ["ab", "ax"], 2, r"env 1: characters \['x'\]")
    _raises(space, np.zeros(2), 2, "expected 2 strings, got ndarray")


def test_non_array_leaf() -> None:
    _raises(spaces.Discrete(2), [0, 1], 2, "expected an array, got list")


def _box(shape: list[int], bound_shape: list[int] | None = None) -> space_pb2.Space:
    bound = np.zeros(shape if bound_shape is None else bound_shape, np.float32)
    return space_pb2.Space(
        box=space_pb2.BoxSpace(
            dtype=tensor_pb2.DType.D_TYPE_FLOAT32,
            shape=shape,
            low=tensor.encode(bound),
            high=tensor.encode(bound + 1),
        )
    )


@pytest.mark.parametrize(
    ("msg", "field", "match"),
    [
        (
            space_pb2.Space(multi_binary=space_pb2.MultiBinarySpace(shape=[0, 2**62, 2**62])),
            "space.shape",
            "too large",
        ),
        (
            space_pb2.Space(multi_binary=space_pb2.MultiBinarySpace(shape=[0, 3])),
            "space",
            "positive",
        ),
        (space_pb2.Space(discrete=space_pb2.DiscreteSpace(n=0)), "space", "positive"),
        (_box([0, 2**62, 2**62], [0]), "space.shape", "too large"),
        (_box([2**20, 2**20], []), "space.low", "sample shape"),  # would allocate 4 TiB
        (_box([3], [2]), "space.low", "sample shape"),
        (
            space_pb2.Space(dict=space_pb2.DictSpace(spaces=[space_pb2.NamedSpace(name="k")])),
            "space.k",
            "empty Space",
        ),
    ],
)
def test_bad_space_messages_are_invalid_argument(msg, field: str, match: str) -> None:
    """gymnasium's and numpy's ValueErrors (n <= 0, overflowing shapes) used to escape."""
    with pytest.raises(InvalidArgument, match=match) as err:
        wire.from_proto(msg)
    assert err.value.field == field
    assert wire.from_proto(_box([3])) == spaces.Box(0.0, 1.0, (3,), np.float32)


def test_finite_observations_name_the_leaf_row_and_element_or_clip_to_the_bounds() -> None:
    space = spaces.Dict(
        {
            "pos": spaces.Box(np.array([-1.0, -np.inf]), np.array([2.0, np.inf]), dtype=np.float32),
            "cell": spaces.Discrete(3),
        }
    )
    pos = np.zeros((3, 2), np.float32)
    pos[2, 1] = np.nan
    batch = {"pos": pos, "cell": np.zeros(3, np.int64)}
    with pytest.raises(InvalidArgument, match=r"env 2 \(row 2\): nan at \[1\]") as err:
        wire.finite_observations(space, batch, name="step.observations")
    assert err.value.field == "step.observations.pos"
    pos[0] = [np.inf, -np.inf]
    clipped = wire.finite_observations(space, batch, name="x", who="agent", clip=True)
    biggest = float(np.finfo(np.float32).max)
    assert clipped["pos"].tolist() == [[2.0, -biggest], [0.0, 0.0], [0.0, 0.0]]
