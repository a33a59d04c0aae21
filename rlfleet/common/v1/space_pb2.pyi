# Generated from protos/ by scripts/gen_protos.py. Do not edit.
from rlfleet.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Space(_message.Message):
    __slots__ = ("box", "discrete", "multi_discrete", "multi_binary", "dict", "tuple", "text")
    BOX_FIELD_NUMBER: _ClassVar[int]
    DISCRETE_FIELD_NUMBER: _ClassVar[int]
    MULTI_DISCRETE_FIELD_NUMBER: _ClassVar[int]
    MULTI_BINARY_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    box: BoxSpace
    discrete: DiscreteSpace
    multi_discrete: MultiDiscreteSpace
    multi_binary: MultiBinarySpace
    dict: DictSpace
    tuple: TupleSpace
    text: TextSpace
    def __init__(self, box: _Optional[_Union[BoxSpace, _Mapping]] = ..., discrete: _Optional[_Union[DiscreteSpace, _Mapping]] = ..., multi_discrete: _Optional[_Union[MultiDiscreteSpace, _Mapping]] = ..., multi_binary: _Optional[_Union[MultiBinarySpace, _Mapping]] = ..., dict: _Optional[_Union[DictSpace, _Mapping]] = ..., tuple: _Optional[_Union[TupleSpace, _Mapping]] = ..., text: _Optional[_Union[TextSpace, _Mapping]] = ...) -> None: ...

class BoxSpace(_message.Message):
    __slots__ = ("dtype", "shape", "low", "high")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    low: _tensor_pb2.Tensor
    high: _tensor_pb2.Tensor
    def __init__(self, dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., low: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., high: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DiscreteSpace(_message.Message):
    __slots__ = ("n", "start", "dtype")
    N_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    n: int
    start: int
    dtype: _tensor_pb2.DType
    def __init__(self, n: _Optional[int] = ..., start: _Optional[int] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ...) -> None: ...

class MultiDiscreteSpace(_message.Message):
    __slots__ = ("nvec", "start", "dtype")
    NVEC_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    nvec: _tensor_pb2.Tensor
    start: _tensor_pb2.Tensor
    dtype: _tensor_pb2.DType
    def __init__(self, nvec: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., start: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ...) -> None: ...

class MultiBinarySpace(_message.Message):
    __slots__ = ("shape",)
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DictSpace(_message.Message):
    __slots__ = ("spaces",)
    SPACES_FIELD_NUMBER: _ClassVar[int]
    spaces: _containers.RepeatedCompositeFieldContainer[NamedSpace]
    def __init__(self, spaces: _Optional[_Iterable[_Union[NamedSpace, _Mapping]]] = ...) -> None: ...

class NamedSpace(_message.Message):
    __slots__ = ("name", "space")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    space: Space
    def __init__(self, name: _Optional[str] = ..., space: _Optional[_Union[Space, _Mapping]] = ...) -> None: ...

class TupleSpace(_message.Message):
    __slots__ = ("spaces",)
    SPACES_FIELD_NUMBER: _ClassVar[int]
    spaces: _containers.RepeatedCompositeFieldContainer[Space]
    def __init__(self, spaces: _Optional[_Iterable[_Union[Space, _Mapping]]] = ...) -> None: ...

class TextSpace(_message.Message):
    __slots__ = ("min_length", "max_length", "charset")
    MIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHARSET_FIELD_NUMBER: _ClassVar[int]
    min_length: int
    max_length: int
    charset: str
    def __init__(self, min_length: _Optional[int] = ..., max_length: _Optional[int] = ..., charset: _Optional[str] = ...) -> None: ...
