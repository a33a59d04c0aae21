"""common/tensor.py: numpy/torch <-> rlfleet.common.v1.Tensor and TensorTree."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common import tensor as codec
from rlfleet.common.v1 import tensor_pb2
from services.errors import InvalidArgument

DType = tensor_pb2.DType

NUMPY_DTYPES = {
    DType.D_TYPE_FLOAT32: np.float32,
    DType.D_TYPE_FLOAT64: np.float64,
    DType.D_TYPE_FLOAT16: np.float16,
    DType.D_TYPE_INT8: np.int8,
    DType.D_TYPE_INT16: np.int16,
    DType.D_TYPE_INT32: np.int32,
    DType.D_TYPE_INT64: np.int64,
    DType.D_TYPE_UINT8: np.uint8,
    DType.D_TYPE_UINT16: np.uint16,
    DType.D_TYPE_UINT32: np.uint32,
    DType.D_TYPE_UINT64: np.uint64,
    DType.D_TYPE_BOOL: np.bool_,
}
TORCH_DTYPES = {
    DType.D_TYPE_FLOAT32: torch.float32,
    DType.D_TYPE_FLOAT64: torch.float64,
    DType.D_TYPE_FLOAT16: torch.float16,
    DType.D_TYPE_BFLOAT16: torch.bfloat16,
    DType.D_TYPE_INT8: torch.int8,
    DType.D_TYPE_INT16: torch.int16,
    DType.D_TYPE_INT32: torch.int32,
    DType.D_TYPE_INT64: torch.int64,
    DType.D_TYPE_UINT8: torch.uint8,
    DType.D_TYPE_UINT16: torch.uint16,
    DType.D_TYPE_UINT32: torch.uint32,
    DType.D_TYPE_UINT64: torch.uint64,
    DType.D_TYPE_BOOL: torch.bool,
}


def test_every_dtype_is_covered():
    everything = set(DType.values()) - {DType.D_TYPE_UNSPECIFIED}
    assert set(NUMPY_DTYPES) | {DType.D_TYPE_BFLOAT16} == everything
    assert set(TORCH_DTYPES) == everything


def _sample(np_dtype, shape=(2, 3, 4)) -> np.ndarray:
    n = int(np.prod(shape))
    if np_dtype is np.bool_:
        return (np.arange(n) % 3 == 0).reshape(shape)
    info = np.finfo(np_dtype) if np.issubdtype(np_dtype, np.floating) else np.iinfo(np_dtype)
    values = np.arange(n).astype(np_dtype).reshape(shape)
    flat = values.reshape(-1)
    flat[0], flat[-1] = info.min, info.max  # the extremes survive too
    return values


@pytest.mark.parametrize("code", sorted(NUMPY_DTYPES), ids=codec.dtype_name)
def test_numpy_round_trip(code):
    array = _sample(NUMPY_DTYPES[code])
    msg = codec.encode(array)
    assert msg.dtype == code
    assert list(msg.shape) == [2, 3, 4]
    assert len(msg.data) == array.nbytes
    back = codec.decode(tensor_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_wire_bytes_are_little_endian_row_major():
    msg = codec.encode(np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert msg.data == b"".join(i.to_bytes(4, "little") for i in (1, 2, 3, 4))


def test_float_specials_round_trip():
    array = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], dtype=np.float32)
    back = codec.decode(codec.encode(array))
    assert back.tobytes() == array.tobytes()


@pytest.mark.parametrize("code", sorted(TORCH_DTYPES), ids=codec.dtype_name)
def test_torch_round_trip(code):
    dtype = TORCH_DTYPES[code]
    if dtype == torch.bool:
        tensor = torch.arange(24).reshape(2, 3, 4) % 3 == 0
    elif dtype.is_floating_point:
        tensor = (torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    else:
        tensor = torch.arange(24).reshape(2, 3, 4).to(dtype)
    msg = codec.encode(tensor)
    assert msg.dtype == code
    assert list(msg.shape) == [2, 3, 4]
    back = codec.decode_torch(tensor_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and back.shape == tensor.shape
    # Bitwise equality (compare the raw bytes; some unsigned dtypes lack torch.equal kernels).
    as_bytes = lambda t: t.contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731
    assert as_bytes(back) == as_bytes(tensor)


def test_bfloat16_travels_as_its_uint16_words():
    tensor = torch.tensor([1.0, -2.5, 3.140625, float("inf")], dtype=torch.bfloat16)
    msg = codec.encode(tensor)
    assert msg.dtype == DType.D_TYPE_BFLOAT16
    words = codec.decode(msg)  # numpy has no bfloat16: the storage words come back
    assert words.dtype == np.uint16
    np.testing.assert_array_equal(words, tensor.view(torch.uint16).numpy())
    # bfloat16 is the upper half of the float32 with the same value.
    np.testing.assert_array_equal(
        words, (tensor.float().numpy().view(np.uint32) >> 16).astype(np.uint16)
    )
    assert torch.equal(codec.decode_torch(msg), tensor)


def test_torch_encode_detaches_and_moves_noncontiguous():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4).requires_grad_()
    transposed = base.t()  # non-contiguous, needs grad
    back = codec.decode(codec.encode(transposed))
    np.testing.assert_array_equal(back, transposed.detach().numpy())


def test_noncontiguous_and_fortran_numpy_arrays_encode_in_c_order():
    array = np.arange(24, dtype=np.int16).reshape(4, 6)
    for view in (array.T, array[:, ::2], np.asfortranarray(array)):
        np.testing.assert_array_equal(codec.decode(codec.encode(view)), view)


def test_scalars_and_empty_arrays():
    for value in (np.float32(2.5), 7, True, 1.5):
        msg = codec.encode(value)
        assert list(msg.shape) == []
        assert codec.decode(msg).item() == value
    empty = np.zeros((0, 3), dtype=np.float32)
    msg = codec.encode(empty)
    assert list(msg.shape) == [0, 3] and msg.data == b""
    assert codec.decode(msg).shape == (0, 3)


@pytest.mark.parametrize(
    "np_dtype", [">f4", ">f8", ">i2", ">i4", ">i8", ">u2", ">u4", ">u8", ">f2"]
)
def test_big_endian_input_is_encoded_little_endian(np_dtype):
    native = np.array([[1, 2, 300], [-4 if "u" not in np_dtype else 4, 5, 6]]).astype(np_dtype)
    assert native.dtype.byteorder == ">"
    msg = codec.encode(native)
    expected = native.astype(native.dtype.newbyteorder("<"))
    assert msg.data == expected.tobytes()
    back = codec.decode(msg)
    assert back.dtype.byteorder in "<=|"
    np.testing.assert_array_equal(back, native)


# --- zero copy ----------------------------------------------------------------------------------


def _root_base(array: np.ndarray):
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


def test_decode_is_a_read_only_view_of_the_message_bytes():
    msg = codec.encode(np.arange(1000, dtype=np.float32).reshape(10, 100))
    array = codec.decode(msg)
    assert not array.flags.writeable
    assert not array.flags.owndata
    root = _root_base(array)
    assert isinstance(root, bytes) and root == msg.data  # a view over the bytes, not a copy
    with pytest.raises(ValueError, match="read-only"):
        array[0, 0] = 1.0


def test_decode_shares_memory_with_the_buffer_it_is_given():
    # The protobuf runtime (upb) hands out a fresh bytes object on every `msg.data` access; a
    # message-like object that always returns the same buffer shows decode itself copies nothing.
    payload = np.arange(64, dtype=np.int64).tobytes()
    msg = SimpleNamespace(dtype=DType.D_TYPE_INT64, shape=[8, 8], data=payload)
    array = codec.decode(msg)
    assert np.shares_memory(array, np.frombuffer(payload, dtype=np.uint8))
    tensor = codec.decode_torch(msg)
    assert tensor.data_ptr() == array.__array_interface__["data"][0]


def test_decode_torch_bfloat16_shares_memory():
    payload = torch.randn(16).to(torch.bfloat16).view(torch.uint16).numpy().tobytes()
    msg = SimpleNamespace(dtype=DType.D_TYPE_BFLOAT16, shape=[4, 4], data=payload)
    tensor = codec.decode_torch(msg)
    assert tensor.dtype == torch.bfloat16
    assert np.shares_memory(tensor.view(torch.uint16).numpy(), np.frombuffer(payload, np.uint8))


# --- errors ------------------------------------------------------------------------------------


def test_data_length_mismatch_names_the_field_and_sizes():
    msg = tensor_pb2.Tensor(dtype=DType.D_TYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(InvalidArgument) as info:
        codec.decode(msg, name="observations")
    assert info.value.field == "observations"
    assert "20 data bytes" in info.value.message and "24 bytes" in info.value.message


def test_negative_extent_is_rejected():
    msg = tensor_pb2.Tensor(dtype=DType.D_TYPE_FLOAT32, shape=[-1, 2], data=b"")
    with pytest.raises(InvalidArgument, match="negative extent") as info:
        codec.decode(msg, name="rewards")
    assert info.value.field == "rewards"


@pytest.mark.parametrize("code", [DType.D_TYPE_UNSPECIFIED, 99])
def test_unspecified_or_unknown_dtype_is_rejected(code):
    msg = tensor_pb2.Tensor(dtype=code, shape=[1], data=b"\0")
    with pytest.raises(InvalidArgument, match="unspecified" if code == 0 else "99"):
        codec.decode(msg)


def test_unsupported_numpy_dtype_is_rejected():
    with pytest.raises(InvalidArgument, match="complex64"):
        codec.encode(np.zeros(2, dtype=np.complex64))
    with pytest.raises(InvalidArgument, match="has no"):
        codec.encode(np.array(["a", "b"]))
    # torch dtypes numpy cannot represent are bad input too, not a TypeError from .numpy()
    with pytest.raises(InvalidArgument, match="float8_e4m3fn"):
        codec.encode(torch.zeros(2, dtype=torch.float8_e4m3fn))
    with pytest.raises(InvalidArgument, match="complex64"):
        codec.encode(torch.zeros(2, dtype=torch.complex64))


def test_spec_dtype_mismatch_names_the_field():
    msg = codec.encode(np.zeros((4, 2), dtype=np.float64))
    spec = codec.spec("actions", np.float32, [-1, 2])
    with pytest.raises(InvalidArgument) as info:
        codec.decode(msg, spec)
    assert info.value.field == "actions"
    assert "expected dtype float32, got float64" in str(info.value)


def test_spec_shape_with_minus_one_accepts_any_extent_there():
    spec = codec.spec("obs", np.float32, [-1, 4])
    for n in (0, 1, 7):
        codec.decode(codec.encode(np.zeros((n, 4), dtype=np.float32)), spec)
    for bad in ((3, 5), (3,), (3, 4, 1)):
        with pytest.raises(InvalidArgument) as info:
            codec.decode(codec.encode(np.zeros(bad, dtype=np.float32)), spec)
        assert info.value.field == "obs"
        assert "expected shape ['*', 4]" in info.value.message
        assert str(list(bad)) in info.value.message


def test_spec_without_a_name_uses_the_callers_name():
    spec = codec.spec("", np.int64, [3])
    with pytest.raises(InvalidArgument) as info:
        codec.decode(codec.encode(np.zeros(2, dtype=np.int64)), spec, name="episode_ids")
    assert info.value.field == "episode_ids"


def test_spec_accepts_bfloat16_by_its_wire_dtype():
    msg = codec.encode(torch.zeros(2, 3, dtype=torch.bfloat16))
    codec.decode(msg, codec.spec("w", DType.D_TYPE_BFLOAT16, [2, 3]))
    with pytest.raises(InvalidArgument, match="expected dtype uint16, got bfloat16"):
        codec.decode(msg, codec.spec("w", np.uint16, [2, 3]))


def test_check_on_plain_arrays():
    spec = codec.spec("rewards", np.float32, [-1])
    codec.check(np.zeros(5, dtype=np.float32), spec)
    with pytest.raises(InvalidArgument) as info:
        codec.check(np.zeros((5, 1), dtype=np.float32), spec)
    assert info.value.field == "rewards"
    with pytest.raises(InvalidArgument) as info:
        codec.check(np.zeros(5, dtype=np.float64), spec, name="step.rewards")
    assert info.value.field == "step.rewards"


# --- trees -------------------------------------------------------------------------------------


def _assert_tree_equal(got, want):
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            _assert_tree_equal(got[key], want[key])
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_tree_equal(g, w)
    elif isinstance(want, list):
        assert got == want
    else:
        assert isinstance(got, np.ndarray)
        assert got.dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(got, want)


def test_tree_round_trip_with_dict_tuple_and_texts():
    n = 3
    value = {
        "image": np.arange(n * 4 * 4 * 3, dtype=np.uint8).reshape(n, 4, 4, 3),
        "state": (np.ones((n, 2), dtype=np.float32), np.array([0, 1, 2], dtype=np.int64)),
        "mission": ["go left", "pick up the key", "ünïcode ✓"],
        "nested": {"flag": np.array([True, False, True])},
    }
    msg = codec.encode_tree(value)
    assert msg.WhichOneof("node") == "dict"
    wire = tensor_pb2.TensorTree.FromString(msg.SerializeToString())
    _assert_tree_equal(codec.decode_tree(wire), value)


def test_tree_leaf_and_numpy_text_batch():
    leaf = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert codec.encode_tree(leaf).WhichOneof("node") == "tensor"
    _assert_tree_equal(codec.decode_tree(codec.encode_tree(leaf)), leaf)
    texts = np.array(["a", "bc"])
    msg = codec.encode_tree(texts)
    assert msg.WhichOneof("node") == "texts"
    assert codec.decode_tree(msg) == ["a", "bc"]


def test_tree_errors_name_the_path():
    bad = tensor_pb2.Tensor(dtype=DType.D_TYPE_FLOAT32, shape=[2], data=b"\0" * 4)
    tree = tensor_pb2.TensorTree(
        dict=tensor_pb2.TensorTreeDict(
            items={
                "state": tensor_pb2.TensorTree(
                    tuple=tensor_pb2.TensorTreeList(items=[tensor_pb2.TensorTree(tensor=bad)])
                )
            }
        )
    )
    with pytest.raises(InvalidArgument) as info:
        codec.decode_tree(tree, name="observations")
    assert info.value.field == "observations.state[0]"
    with pytest.raises(InvalidArgument, match="empty TensorTree") as info:
        codec.decode_tree(tensor_pb2.TensorTree(), name="actions")
    assert info.value.field == "actions"


@pytest.mark.parametrize(
    "shape",
    [[0, 2**62, 2**62], [2**62, 2**62, 0], [0, 2**63 - 1], [2**61, 0], [1] * 33],
)
def test_shapes_numpy_cannot_hold_are_invalid_argument(shape):
    """Zero elements, so the (empty) data matched; numpy's reshape raised ValueError (INTERNAL)."""
    msg = tensor_pb2.Tensor(dtype=DType.D_TYPE_FLOAT32, shape=shape, data=b"")
    with pytest.raises(InvalidArgument, match=r"too large|dimensions") as err:
        codec.decode(msg, name="actions")
    assert err.value.field == "actions"


def test_big_empty_shapes_that_fit_still_decode():
    msg = tensor_pb2.Tensor(dtype=DType.D_TYPE_UINT8, shape=[0, 2**40, 2**20], data=b"")
    assert codec.decode(msg).shape == (0, 2**40, 2**20)
    assert codec.check_shape([2, 3], 8) == (2, 3)
    assert codec.decode(codec.encode(np.zeros([1] * 32, np.int8))).ndim == 32
