# Generated from protos/ by scripts/gen_protos.py. Do not edit.
import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rlfleet.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("run", "version", "tensors", "total_bytes", "digest", "base_model", "create_time")
    RUN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    run: str
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[WeightTensor]
    total_bytes: int
    digest: str
    base_model: str
    create_time: _timestamp_pb2.Timestamp
    def __init__(self, run: _Optional[str] = ..., version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[WeightTensor, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., digest: _Optional[str] = ..., base_model: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WeightTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("version", "start_offset", "end_offset", "max_chunk_bytes", "expected_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    start_offset: int
    end_offset: int
    max_chunk_bytes: int
    expected_digest: str
    def __init__(self, version: _Optional[int] = ..., start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., expected_digest: _Optional[str] = ...) -> None: ...

class FetchWeightsResponse(_message.Message):
    __slots__ = ("offset", "data", "tensor_index", "tensor_name", "crc32", "last")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    tensor_index: int
    tensor_name: str
    crc32: int
    last: bool
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., tensor_index: _Optional[int] = ..., tensor_name: _Optional[str] = ..., crc32: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("run", "versions")
    RUN_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    run: str
    versions: _containers.RepeatedCompositeFieldContainer[WeightVersionInfo]
    def __init__(self, run: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[WeightVersionInfo, _Mapping]]] = ...) -> None: ...

class WeightVersionInfo(_message.Message):
    __slots__ = ("version", "digest", "total_bytes", "num_tensors", "create_time")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    version: int
    digest: str
    total_bytes: int
    num_tensors: int
    create_time: _timestamp_pb2.Timestamp
    def __init__(self, version: _Optional[int] = ..., digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
