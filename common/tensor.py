"""Tensor codec: numpy/torch arrays <-> `rlfleet.common.v1.Tensor` and `TensorTree`.

Decoding never copies: `decode` returns a read-only `np.frombuffer` view over the message's bytes.
Encoding copies once (`tobytes`), which protobuf needs anyway to own the payload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from rlfleet.common.v1 import tensor_pb2
from services.errors import InvalidArgument

DType = tensor_pb2.DType

# numpy has no bfloat16: it travels as raw uint16 words and torch reinterprets them.
_TO_NUMPY: dict[DType, np.dtype] = {
    DType.D_TYPE_FLOAT32: np.dtype("<f4"),
    DType.D_TYPE_FLOAT64: np.dtype("<f8"),
    DType.D_TYPE_FLOAT16: np.dtype("<f2"),
    DType.D_TYPE_BFLOAT16: np.dtype("<u2"),
    DType.D_TYPE_INT8: np.dtype("i1"),
    DType.D_TYPE_INT16: np.dtype("<i2"),
    DType.D_TYPE_INT32: np.dtype("<i4"),
    DType.D_TYPE_INT64: np.dtype("<i8"),
    DType.D_TYPE_UINT8: np.dtype("u1"),
    DType.D_TYPE_UINT16: np.dtype("<u2"),
    DType.D_TYPE_UINT32: np.dtype("<u4"),
    DType.D_TYPE_UINT64: np.dtype("<u8"),
    DType.D_TYPE_BOOL: np.dtype("?"),
}
_FROM_NUMPY: dict[np.dtype, DType] = {
    dt.newbyteorder("="): code for code, dt in _TO_NUMPY.items() if code != DType.D_TYPE_BFLOAT16
}


def as_dtype(code: int) -> DType:
    """``code`` typed as a DType. The generated stubs make DType a subclass of int, but its values
    are plain ints at run time and protobuf takes any int for an enum field: nothing converts."""
    return cast(DType, code)


def dtype_name(code: int) -> str:
    """Short name of a DType code for error messages ("float32")."""
    if code in DType.values():
        return DType.Name(code).removeprefix("D_TYPE_").lower()
    return str(code)


def to_dtype_code(dtype: Any) -> DType:
    """DType code of a numpy dtype (or anything np.dtype accepts)."""
    dt = np.dtype(dtype).newbyteorder("=")
    try:
        return _FROM_NUMPY[dt]
    except KeyError:
        raise InvalidArgument(f"dtype {dt} has no rlfleet.common.v1.DType") from None


def numpy_dtype(code: int) -> np.dtype:
    """numpy dtype for a DType code (bfloat16 maps to its uint16 storage)."""
    try:
        return _TO_NUMPY[as_dtype(code)]
    except KeyError:
        raise InvalidArgument(f"unsupported or unspecified dtype {dtype_name(code)}") from None


def encode(array: Any) -> tensor_pb2.Tensor:
    """Encode a numpy array, a torch tensor or a scalar into a Tensor message."""
    if type(array).__module__.startswith("torch"):
        return _encode_torch(array)
    arr = np.asarray(array)
    code = to_dtype_code(arr.dtype)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return tensor_pb2.Tensor(dtype=code, shape=arr.shape, data=arr.tobytes(order="C"))


def _encode_torch(tensor: Any) -> tensor_pb2.Tensor:
    import torch

    t = tensor.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        data = t.view(torch.uint16).numpy().tobytes()
        return tensor_pb2.Tensor(dtype=DType.D_TYPE_BFLOAT16, shape=t.shape, data=data)
    try:
        array = t.numpy()
    except TypeError:  # float8, int4, ...: torch dtypes numpy cannot hold
        raise InvalidArgument(f"dtype {t.dtype} has no rlfleet.common.v1.DType") from None
    return encode(array)


def decode(
    msg: tensor_pb2.Tensor, spec: tensor_pb2.TensorSpec | None = None, *, name: str = "tensor"
) -> np.ndarray:
    """View a Tensor message as a read-only numpy array, checking it against `spec` if given."""
    dt = numpy_dtype(msg.dtype)
    shape = check_shape(msg.shape, dt.itemsize, name=name)
    expected = math.prod(shape) * dt.itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(
            f"{name}: {len(msg.data)} data bytes do not match shape {list(shape)} of "
            f"{dtype_name(msg.dtype)} ({expected} bytes)",
            field=name,
        )
    array = np.frombuffer(msg.data, dtype=dt).reshape(shape)
    if spec is not None:
        check(array, spec, name=spec.name or name, dtype_code=msg.dtype)
    return array


# numpy's limits: at most 64 dimensions (32 before numpy 2), and the product of the non-zero
# extents times the item size must fit in a signed 64-bit index, even when another extent is 0.
MAX_DIMS = 32
_MAX_INDEX = (1 << 63) - 1


def check_shape(
    shape: Sequence[int], itemsize: int = 1, *, name: str = "tensor"
) -> tuple[int, ...]:
    """``shape`` as a tuple, or InvalidArgument naming ``name`` when numpy cannot hold it.

    Rejects negative extents, more than MAX_DIMS dimensions and shapes whose size overflows
    (e.g. ``[0, 2**62, 2**62]``: zero elements, but numpy refuses it with a ValueError).
    """
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{name}: negative extent in shape {list(dims)}", field=name)
    if len(dims) > MAX_DIMS:
        raise InvalidArgument(
            f"{name}: {len(dims)} dimensions, more than the {MAX_DIMS} supported", field=name
        )
    size = max(itemsize, 1)
    for d in dims:
        size *= max(d, 1)
        if size > _MAX_INDEX:
            raise InvalidArgument(
                f"{name}: shape {list(dims)} is too large (its size overflows 64 bits)",
                field=name,
            )
    return dims


def decode_torch(msg: tensor_pb2.Tensor, *, name: str = "tensor") -> Any:
    """Decode into a torch tensor sharing the message's memory (read-only: clone before writing)."""
    import warnings

    import torch

    array = decode(msg, name=name)
    with warnings.catch_warnings():  # torch warns that the buffer is read-only; callers know
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if msg.dtype == DType.D_TYPE_BFLOAT16 else tensor


def spec(name: str, dtype: Any, shape: Sequence[int]) -> tensor_pb2.TensorSpec:
    """Build a TensorSpec; dtype is a numpy dtype or a DType code, -1 in shape = any extent."""
    code = as_dtype(dtype) if isinstance(dtype, int) else to_dtype_code(dtype)
    return tensor_pb2.TensorSpec(name=name, dtype=code, shape=list(shape))


def check(
    array: np.ndarray,
    spec: tensor_pb2.TensorSpec,
    name: str | None = None,
    *,
    dtype_code: int | None = None,
) -> None:
    """Raise InvalidArgument naming `name` unless `array` matches `spec` in dtype and shape."""
    name = name or spec.name or "tensor"
    got_code = dtype_code if dtype_code is not None else to_dtype_code(array.dtype)
    if spec.dtype != DType.D_TYPE_UNSPECIFIED and got_code != spec.dtype:
        raise InvalidArgument(
            f"{name}: expected dtype {dtype_name(spec.dtype)}, got {dtype_name(got_code)}",
            field=name,
        )
    want = list(spec.shape)
    fits = len(want) == array.ndim and all(
        w in (-1, g) for w, g in zip(want, array.shape, strict=True)
    )
    if not fits:
        shown = ["*" if w == -1 else w for w in want]
        raise InvalidArgument(
            f"{name}: expected shape {shown}, got {list(array.shape)}", field=name
        )


def encode_tree(value: Any) -> tensor_pb2.TensorTree:
    """Encode an array, a dict/tuple of them (nested), or a list/array of strings."""
    if isinstance(value, Mapping):
        items = {str(k): encode_tree(v) for k, v in value.items()}
        return tensor_pb2.TensorTree(dict=tensor_pb2.TensorTreeDict(items=items))
    if isinstance(value, tuple):
        children = [encode_tree(v) for v in value]
        return tensor_pb2.TensorTree(tuple=tensor_pb2.TensorTreeList(items=children))
    if _is_text_batch(value):
        return tensor_pb2.TensorTree(texts=tensor_pb2.TextBatch(values=[str(v) for v in value]))
    return tensor_pb2.TensorTree(tensor=encode(value))


def _is_text_batch(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return (
            value.dtype.kind in "UO" and value.ndim == 1 and all(isinstance(v, str) for v in value)
        )
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def decode_tree(msg: tensor_pb2.TensorTree, *, name: str = "tree") -> Any:
    """Inverse of encode_tree: arrays (read-only views), dicts, tuples, lists of str."""
    kind = msg.WhichOneof("node")
    if kind == "tensor":
        return decode(msg.tensor, name=name)
    if kind == "dict":
        return {k: decode_tree(v, name=f"{name}.{k}") for k, v in msg.dict.items.items()}
    if kind == "tuple":
        return tuple(decode_tree(v, name=f"{name}[{i}]") for i, v in enumerate(msg.tuple.items))
    if kind == "texts":
        return list(msg.texts.values)
    raise InvalidArgument(f"{name}: empty TensorTree (no tensor, dict, tuple or texts)", field=name)
