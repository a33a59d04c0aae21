"""gymnasium spaces <-> `rlfleet.common.v1.Space`, batch specs, and action validation.

Both ends of an `EnvService.Session` need this: the server describes its spaces and checks every
action batch before any environment sees it (a bad action must never reach user code, and must
not step some environments but not others); the client rebuilds the spaces to look like a local
gymnasium env. gymnasium is imported lazily so `services` keeps no hard dependency on it.

Accepted action dtypes (strict otherwise):
- Discrete / MultiDiscrete: any integer dtype (signed or unsigned), range-checked, then cast to
  the space's dtype.
- Box with a float32 dtype: float64 is accepted and cast to float32, because numpy's default
  float is float64 and the values keep their meaning; every other Box must match its dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from common import tensor
from rlfleet.common.v1 import space_pb2, tensor_pb2
from services.errors import InvalidArgument

if TYPE_CHECKING:
    import gymnasium

__all__ = [
    "SpecTree",
    "batch_specs",
    "finite_observations",
    "from_proto",
    "to_proto",
    "validate_actions",
]

# A TensorSpec per leaf, nested like the space: dict for Dict, tuple for Tuple. A Text leaf is a
# TensorSpec with D_TYPE_UNSPECIFIED and shape [N]: N strings, no element type.
SpecTree: TypeAlias = "tensor_pb2.TensorSpec | dict[str, SpecTree] | tuple[SpecTree, ...]"

_INT64 = tensor_pb2.DType.D_TYPE_INT64


def to_proto(space: gymnasium.Space) -> space_pb2.Space:
    """Describe one environment's gymnasium space as a `Space` message (nested spaces too)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Box):
        return space_pb2.Space(
            box=space_pb2.BoxSpace(
                dtype=tensor.to_dtype_code(space.dtype),
                shape=space.shape,
                low=tensor.encode(space.low),
                high=tensor.encode(space.high),
            )
        )
    if isinstance(space, spaces.Discrete):
        return space_pb2.Space(
            discrete=space_pb2.DiscreteSpace(
                n=int(space.n), start=int(space.start), dtype=tensor.to_dtype_code(space.dtype)
            )
        )
    if isinstance(space, spaces.MultiDiscrete):
        return space_pb2.Space(
            multi_discrete=space_pb2.MultiDiscreteSpace(
                nvec=tensor.encode(space.nvec.astype(np.int64)),
                start=tensor.encode(space.start.astype(np.int64)),
                dtype=tensor.to_dtype_code(space.dtype),
            )
        )
    if isinstance(space, spaces.MultiBinary):
        return space_pb2.Space(multi_binary=space_pb2.MultiBinarySpace(shape=space.shape))
    if isinstance(space, spaces.Dict):
        named = [space_pb2.NamedSpace(name=k, space=to_proto(v)) for k, v in space.spaces.items()]
        return space_pb2.Space(dict=space_pb2.DictSpace(spaces=named))
    if isinstance(space, spaces.Tuple):
        return space_pb2.Space(
            tuple=space_pb2.TupleSpace(spaces=[to_proto(s) for s in space.spaces])
        )
    if isinstance(space, spaces.Text):
        from gymnasium.spaces.text import alphanumeric

        charset = "" if space.character_set == alphanumeric else "".join(space.character_list)
        return space_pb2.Space(
            text=space_pb2.TextSpace(
                min_length=space.min_length, max_length=space.max_length, charset=charset
            )
        )
    raise InvalidArgument(f"space {type(space).__name__} has no rlfleet.common.v1.Space form")


def from_proto(msg: space_pb2.Space, *, name: str = "space") -> gymnasium.Space:
    """Rebuild the gymnasium space a `Space` message describes (inverse of `to_proto`).

    MultiBinary comes back as ``MultiBinary(k)`` for a 1-d shape ``[k]`` (gymnasium's usual form).
    """
    kind = msg.WhichOneof("kind")
    if kind in ("box", "discrete", "multi_discrete", "multi_binary"):
        try:
            return _leaf_from_proto(msg, kind, name)
        except (ValueError, TypeError, AssertionError, OverflowError) as exc:
            # gymnasium's own checks (n >= 1, positive extents, low <= high, ...).
            raise InvalidArgument(f"{name}: {type(exc).__name__}: {exc}", field=name) from exc
    from gymnasium import spaces

    if kind == "dict":
        return spaces.Dict(
            {n.name: from_proto(n.space, name=f"{name}.{n.name}") for n in msg.dict.spaces}
        )
    if kind == "tuple":
        return spaces.Tuple(
            [from_proto(s, name=f"{name}[{i}]") for i, s in enumerate(msg.tuple.spaces)]
        )
    if kind == "text":
        from gymnasium.spaces.text import alphanumeric

        text = msg.text
        return spaces.Text(
            text.max_length, min_length=text.min_length, charset=text.charset or alphanumeric
        )
    raise InvalidArgument(f"{name}: empty Space (no kind set)", field=name)


def _leaf_from_proto(msg: space_pb2.Space, kind: str, name: str) -> gymnasium.Space:
    """Box, Discrete, MultiDiscrete or MultiBinary; shapes checked before numpy sees them."""
    from gymnasium import spaces

    if kind == "box":
        box = msg.box
        dtype = _np(box.dtype)
        shape = tensor.check_shape(box.shape, dtype.itemsize, name=f"{name}.shape")
        low = tensor.decode(box.low, name=f"{name}.low")
        high = tensor.decode(box.high, name=f"{name}.high")
        for bound, array in (("low", low), ("high", high)):
            # The message carries full bounds (see space.proto): a scalar bound broadcast to a
            # huge shape would allocate it here.
            if array.shape != shape:
                raise InvalidArgument(
                    f"{name}.{bound}: shape {list(array.shape)}, expected the sample shape "
                    f"{list(shape)}",
                    field=f"{name}.{bound}",
                )
        return spaces.Box(low=low, high=high, shape=shape, dtype=dtype)
    if kind == "discrete":
        dtype = _np(msg.discrete.dtype or _INT64)
        return spaces.Discrete(msg.discrete.n, start=msg.discrete.start, dtype=dtype)
    if kind == "multi_discrete":
        md = msg.multi_discrete
        nvec = tensor.decode(md.nvec, name=f"{name}.nvec")
        start = tensor.decode(md.start, name=f"{name}.start") if md.HasField("start") else None
        return spaces.MultiDiscrete(nvec, dtype=_np(md.dtype or _INT64), start=start)
    dims = list(tensor.check_shape(msg.multi_binary.shape, name=f"{name}.shape"))
    return spaces.MultiBinary(dims[0] if len(dims) == 1 else dims)


def _np(code: int) -> np.dtype:
    return tensor.numpy_dtype(code)


def batch_specs(space: gymnasium.Space, n: int, *, name: str = "actions") -> SpecTree:
    """TensorSpecs of a batch of `n` samples of `space` (leading dimension n), nested like it.

    Leaves are named by their path ("actions.pos[1]"), which is what errors quote.
    """
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return {k: batch_specs(s, n, name=f"{name}.{k}") for k, s in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(batch_specs(s, n, name=f"{name}[{i}]") for i, s in enumerate(space.spaces))
    if isinstance(space, spaces.Text):
        return tensor_pb2.TensorSpec(name=name, shape=[n])
    if isinstance(space, spaces.Box | spaces.Discrete | spaces.MultiDiscrete | spaces.MultiBinary):
        # Discrete's shape is typed Space's `tuple | None`; it is () at run time.
        return tensor.spec(name, space.dtype, [n, *(space.shape or ())])
    raise InvalidArgument(f"space {type(space).__name__} has no rlfleet.common.v1.Space form")


def validate_actions(space: gymnasium.Space, actions: Any, n: int, *, name: str = "actions") -> Any:
    """Check a decoded batch of `n` actions against one env's `space`; return it ready to step.

    Raises InvalidArgument naming the field (and the env index and value where one is to blame)
    for a wrong structure, shape or dtype, an out-of-range discrete value, or NaN/inf in a
    continuous action. Integer actions for Discrete/MultiDiscrete and float64 for float32 boxes
    are cast (see the module docstring); everything else is returned as given.
    """
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        if not isinstance(actions, Mapping) or set(actions) != set(space.spaces):
            got = sorted(actions) if isinstance(actions, Mapping) else type(actions).__name__
            raise InvalidArgument(
                f"{name}: expected a dict with keys {sorted(space.spaces)}, got {got}", field=name
            )
        return {
            k: validate_actions(s, actions[k], n, name=f"{name}.{k}")
            for k, s in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple):
        if not isinstance(actions, tuple) or len(actions) != len(space.spaces):
            got = f"{len(actions)} items" if isinstance(actions, tuple) else type(actions).__name__
            raise InvalidArgument(
                f"{name}: expected a tuple of {len(space.spaces)} items, got {got}", field=name
            )
        return tuple(
            validate_actions(s, a, n, name=f"{name}[{i}]")
            for i, (s, a) in enumerate(zip(space.spaces, actions, strict=True))
        )
    if isinstance(space, spaces.Text):
        return _validate_text(space, actions, n, name)
    if not isinstance(actions, np.ndarray):
        raise InvalidArgument(
            f"{name}: expected an array, got {type(actions).__name__}", field=name
        )
    if isinstance(space, spaces.Discrete):
        return _validate_ints(actions, space.dtype, (n,), space.start, space.start + space.n, name)
    if isinstance(space, spaces.MultiDiscrete):
        shape = (n, *space.shape)
        return _validate_ints(
            actions, space.dtype, shape, space.start, space.start + space.nvec, name
        )
    if isinstance(space, spaces.MultiBinary):
        _check_exact(actions, space.dtype, (n, *space.shape), name)
        return _check_range(actions, 0, 2, name)
    if isinstance(space, spaces.Box):
        return _validate_box(space, actions, n, name)
    raise InvalidArgument(f"space {type(space).__name__} has no rlfleet.common.v1.Space form")


def _check_shape(array: np.ndarray, shape: Sequence[int], name: str) -> None:
    if array.shape == tuple(shape):  # every step's case: no TensorSpec to build
        return
    tensor.check(array, tensor_pb2.TensorSpec(name=name, shape=shape))  # any dtype


def _check_exact(array: np.ndarray, dtype: np.dtype, shape: Sequence[int], name: str) -> None:
    tensor.check(array, tensor.spec(name, dtype, shape))


def _validate_ints(
    array: np.ndarray, dtype: np.dtype, shape: Sequence[int], low: Any, high: Any, name: str
) -> np.ndarray:
    if array.dtype.kind not in "iu":
        raise InvalidArgument(
            f"{name}: expected an integer dtype ({dtype}), got {array.dtype}", field=name
        )
    _check_shape(array, shape, name)
    array = _check_range(array, low, high, name)
    return array if array.dtype == dtype else array.astype(dtype)


def _check_range(array: np.ndarray, low: Any, high: Any, name: str) -> np.ndarray:
    """Raise unless low <= array < high (both broadcast over the batch); return array."""
    if array.size == 0:
        return array
    # Scalar bounds (Discrete, the hot path): two reductions, no temporaries.
    if np.ndim(low) == 0 and np.ndim(high) == 0 and array.min() >= low and array.max() < high:
        return array
    bad = (array < low) | (array >= high)
    if not bad.any():
        return array
    where = np.argwhere(bad)[0]
    env, value = int(where[0]), array[tuple(where)].item()
    lo = low if np.ndim(low) == 0 else np.broadcast_to(low, array.shape[1:])[tuple(where[1:])]
    hi = high if np.ndim(high) == 0 else np.broadcast_to(high, array.shape[1:])[tuple(where[1:])]
    at = "".join(f"[{int(i)}]" for i in where[1:])
    raise InvalidArgument(
        f"{name}: env {env}: value {value}{' at ' + at if at else ''} is outside "
        f"[{int(lo)}, {int(hi) - 1}]",
        field=name,
    )


def _validate_box(space: Any, array: np.ndarray, n: int, name: str) -> np.ndarray:
    shape = (n, *space.shape)
    if space.dtype == np.float32 and array.dtype == np.float64:
        _check_shape(array, shape, name)
        array = array.astype(np.float32)
    else:
        _check_exact(array, space.dtype, shape, name)
    if array.dtype.kind == "f":
        finite = np.isfinite(array)
        if not finite.all():
            env = int(np.argwhere(~finite)[0][0])
            raise InvalidArgument(f"{name}: env {env}: action contains NaN or inf", field=name)
    elif array.dtype.kind in "iu":
        _check_range(array, space.low, space.high.astype(np.int64) + 1, name)
    return array


def finite_observations(
    space: gymnasium.Space, obs: Any, *, name: str, who: str = "env", clip: bool = False
) -> Any:
    """`obs`, a batch of observations of `space` (rows: envs or agents), once every float in
    it is finite.

    NaN/inf is InvalidArgument naming the row (`who` and its index), the element and the field
    (`name`, with the key of a Dict/Tuple leaf): a policy trained on it turns every weight NaN.
    With `clip`, a non-finite element becomes 0 (NaN) or the space's bound (inf; the dtype's
    largest value where the bound is infinite) instead, in place unless the array is read-only.
    """
    from gymnasium import spaces

    if isinstance(space, spaces.Dict) and isinstance(obs, Mapping):
        return {
            k: finite_observations(s, obs[k], name=f"{name}.{k}", who=who, clip=clip)
            for k, s in space.spaces.items()
        }
    if isinstance(space, spaces.Tuple) and isinstance(obs, tuple):
        return tuple(
            finite_observations(s, o, name=f"{name}[{i}]", who=who, clip=clip)
            for i, (s, o) in enumerate(zip(space.spaces, obs, strict=True))
        )
    if not isinstance(obs, np.ndarray) or obs.dtype.kind != "f":
        return obs  # integers, booleans and text cannot be NaN
    bad = ~np.isfinite(obs)
    if not bad.any():
        return obs
    if not clip:
        where = np.argwhere(bad)[0]
        row, value = int(where[0]), obs[tuple(where)].item()
        at = "".join(f"[{int(i)}]" for i in where[1:])
        raise InvalidArgument(
            f"{name}: {who} {row} (row {row}): {value}{' at ' + at if at else ''} is not finite "
            f"({int(bad.sum())} non-finite values in the batch)",
            field=name,
        )
    if not obs.flags.writeable:
        obs = obs.copy()
    fixed = np.nan_to_num(obs[bad])  # NaN -> 0, inf -> the dtype's extremes
    if isinstance(space, spaces.Box) and obs.ndim == 1 + len(space.shape):
        low = np.broadcast_to(np.asarray(space.low, obs.dtype), obs.shape)[bad]
        high = np.broadcast_to(np.asarray(space.high, obs.dtype), obs.shape)[bad]
        fixed = np.clip(fixed, low, high)  # an infinite bound leaves the value as it is
    obs[bad] = fixed
    return obs


def _validate_text(space: Any, actions: Any, n: int, name: str) -> list[str]:
    if not isinstance(actions, list) or len(actions) != n:
        got = f"{len(actions)} strings" if isinstance(actions, list) else type(actions).__name__
        raise InvalidArgument(f"{name}: expected {n} strings, got {got}", field=name)
    for env, text in enumerate(actions):
        if not space.min_length <= len(text) <= space.max_length:
            raise InvalidArgument(
                f"{name}: env {env}: length {len(text)} is outside "
                f"[{space.min_length}, {space.max_length}]",
                field=name,
            )
        extra = set(text) - space.character_set
        if extra:
            raise InvalidArgument(
                f"{name}: env {env}: characters {sorted(extra)} are not in the charset", field=name
            )
    return actions
