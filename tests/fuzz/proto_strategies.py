"""Hypothesis strategies built from protobuf descriptors: any message of any rlfleet request type.

`messages(Descriptor)` draws a message field by field from its descriptor: every scalar over its
whole range (NaN and infinities for floats, unknown enum numbers, non-ASCII text, random bytes),
nested messages to a bounded depth, short repeated fields and maps, at most one member of each
oneof. Pure random messages mostly fail the first check a server makes, so `mutations(seed)`
starts from a valid request and replaces, clears or perturbs one field somewhere inside it,
which reaches the checks behind the first one. Tensors get a third strategy, `tensors()`, that
keeps dtype, shape and byte length consistent with each other most of the time, because a
random `bytes` field almost never matches its declared shape.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from rlfleet.common.v1 import tensor_pb2

__all__ = ["messages", "mutations", "tensors"]

F = FieldDescriptor
MAX_REPEATED = 4
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
_ITEM_SIZES = {"BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FLOAT16": 2,
               "BFLOAT16": 2, "INT32": 4, "UINT32": 4, "FLOAT32": 4, "INT64": 8, "UINT64": 8,
               "FLOAT64": 8}  # fmt: skip
_DTYPE_SIZES = {tensor_pb2.DType.Value(f"D_TYPE_{k}"): v for k, v in _ITEM_SIZES.items()}


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """The whole range, with its edges and small numbers (where the interesting checks are)."""
    edges = [v for v in (lo, hi, 0, 1, -1, 2, 255, 256, 65536) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(-8, 300).filter(lambda v: lo <= v <= hi),
                     st.integers(lo, hi))  # fmt: skip


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Any value the field's wire type can hold."""
    t = field.type
    if t in _INT_RANGES:
        return _ints(*_INT_RANGES[t])
    if t == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == F.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.sampled_from(["", "CartPole-v1", "x" * 300]))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=128)
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints(-(2**31), 2**31 - 1))
    raise TypeError(f"{field.full_name}: no scalar strategy for type {t}")


def tensors() -> st.SearchStrategy[tensor_pb2.Tensor]:
    """Tensors whose dtype, shape and data agree (usually) or disagree by a little."""
    names = list(_DTYPE_SIZES)

    @st.composite
    def build(draw: st.DrawFn) -> tensor_pb2.Tensor:
        dtype = draw(st.sampled_from(names))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        count = 1
        for d in shape:
            count *= d
        size = count * _DTYPE_SIZES[dtype]
        size += draw(st.sampled_from([0, 0, 0, 1, -1])) if size else 0
        if draw(st.integers(0, 9)) == 0:  # now and then a dimension no memory could hold
            shape.append(draw(st.sampled_from([2**31, 2**62, -1])))
        data = draw(st.binary(min_size=max(size, 0), max_size=max(size, 0)))
        return tensor_pb2.Tensor(dtype=dtype, shape=[abs(s) for s in shape], data=data)

    return build()


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type, depth=depth - 1)
    return scalar(field)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _assign(msg: Message, field: FieldDescriptor, value: Any) -> None:
    """Set one field (scalar, message, repeated or map) of `msg` to `value`."""
    target = getattr(msg, field.name)
    if _is_map(field):
        value_field = field.message_type.fields_by_name["value"]
        target.clear()
        for key, item in value:
            if value_field.type == F.TYPE_MESSAGE:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        del target[:]
        if field.type == F.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == F.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def field_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    """What `_assign` takes for `field`: a value, a list, or a list of (key, value) pairs."""
    if _is_map(field):
        entry = field.message_type
        pair = st.tuples(scalar(entry.fields_by_name["key"]),
                         _value(entry.fields_by_name["value"], depth))  # fmt: skip
        return st.lists(pair, max_size=MAX_REPEATED)
    if field.is_repeated:
        return st.lists(_value(field, depth), max_size=MAX_REPEATED)
    return _value(field, depth)


def messages(descriptor: Descriptor, *, depth: int = 4) -> st.SearchStrategy[Message]:
    """Any message of `descriptor`'s type (nested messages left empty below `depth`)."""
    cls = _message_class(descriptor)
    if descriptor.full_name == "rlfleet.common.v1.Tensor":
        return st.one_of(tensors(), _fields(descriptor, cls, depth))
    if depth <= 0:
        return st.just(cls())
    return _fields(descriptor, cls, depth)


def _fields(descriptor: Descriptor, cls: type[Message], depth: int) -> st.SearchStrategy[Message]:
    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        chosen = {o.name: draw(st.sampled_from([None, *o.fields])) for o in descriptor.oneofs}
        for field in descriptor.fields:
            oneof = field.containing_oneof
            if oneof is not None and chosen[oneof.name] is not field:
                continue
            if oneof is None and not draw(st.booleans()):
                continue  # leave about half the fields unset
            _assign(msg, field, draw(field_values(field, depth)))
        return msg

    return build()


def _message_class(descriptor: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _paths(msg: Message, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place a mutation can land: (field, ...) into set sub-messages, plus unset fields."""
    out: list[tuple[Any, ...]] = []
    for field in msg.DESCRIPTOR.fields:
        out.append((*prefix, field))
        if field.type != F.TYPE_MESSAGE or _is_map(field):
            continue
        if field.is_repeated:
            for i, item in enumerate(getattr(msg, field.name)):
                out.extend(_paths(item, (*prefix, field, i)))
        elif msg.HasField(field.name):
            out.extend(_paths(getattr(msg, field.name), (*prefix, field)))
    return out


def mutations(seed: Message, *, depth: int = 3) -> st.SearchStrategy[Message]:
    """`seed` with one field somewhere inside it replaced by any value of its type, or cleared."""
    paths = _paths(seed)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = type(seed)()
        msg.CopyFrom(seed)
        path = draw(st.sampled_from(paths))
        owner: Any = msg
        for step in path[:-1]:
            owner = owner[step] if isinstance(step, int) else getattr(owner, step.name)
        field = path[-1]
        if draw(st.integers(0, 4)) == 0:
            owner.ClearField(field.name)
        else:
            _assign(owner, field, draw(field_values(field, depth)))
        return msg

    return build()
