# Generated from protos/ by scripts/gen_protos.py. Do not edit.
import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_DONE: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_DONE: RunState
RUN_STATE_FAILED: RunState

class EpisodeStats(_message.Message):
    __slots__ = ("run", "source", "env_id", "episode_return", "length", "env_steps", "policy_version", "truncated", "time", "partial", "score")
    RUN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    run: str
    source: str
    env_id: str
    episode_return: float
    length: int
    env_steps: int
    policy_version: int
    truncated: bool
    time: _timestamp_pb2.Timestamp
    partial: bool
    score: float
    def __init__(self, run: _Optional[str] = ..., source: _Optional[str] = ..., env_id: _Optional[str] = ..., episode_return: _Optional[float] = ..., length: _Optional[int] = ..., env_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., truncated: _Optional[bool] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., partial: _Optional[bool] = ..., score: _Optional[float] = ...) -> None: ...

class Metrics(_message.Message):
    __slots__ = ("run", "source", "step", "time", "scalars", "policy_version")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    run: str
    source: str
    step: int
    time: _timestamp_pb2.Timestamp
    scalars: _containers.ScalarMap[str, float]
    policy_version: int
    def __init__(self, run: _Optional[str] = ..., source: _Optional[str] = ..., step: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., scalars: _Optional[_Mapping[str, float]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class WeightsPublished(_message.Message):
    __slots__ = ("run", "version", "manifest_digest", "total_bytes", "endpoint", "time", "num_tensors", "taken_sequences")
    class TakenSequencesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    run: str
    version: int
    manifest_digest: str
    total_bytes: int
    endpoint: str
    time: _timestamp_pb2.Timestamp
    num_tensors: int
    taken_sequences: _containers.ScalarMap[str, int]
    def __init__(self, run: _Optional[str] = ..., version: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., endpoint: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., num_tensors: _Optional[int] = ..., taken_sequences: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run", "state", "message", "source", "time")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    run: str
    state: RunState
    message: str
    source: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, run: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., message: _Optional[str] = ..., source: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GroupsDropped(_message.Message):
    __slots__ = ("run", "source", "producer", "count", "reason", "group_ids", "version", "time")
    RUN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    run: str
    source: str
    producer: str
    count: int
    reason: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    version: int
    time: _timestamp_pb2.Timestamp
    def __init__(self, run: _Optional[str] = ..., source: _Optional[str] = ..., producer: _Optional[str] = ..., count: _Optional[int] = ..., reason: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
