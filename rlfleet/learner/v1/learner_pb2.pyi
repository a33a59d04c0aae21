# Generated from protos/ by scripts/gen_protos.py. Do not edit.
import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("run", "policy_version", "updates", "samples_consumed", "messages_consumed", "stale_dropped", "duplicates_dropped", "invalid_dropped", "max_policy_lag", "last_update_time", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    INVALID_DROPPED_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_LAG_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run: str
    policy_version: int
    updates: int
    samples_consumed: int
    messages_consumed: int
    stale_dropped: int
    duplicates_dropped: int
    invalid_dropped: int
    max_policy_lag: int
    last_update_time: _timestamp_pb2.Timestamp
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, run: _Optional[str] = ..., policy_version: _Optional[int] = ..., updates: _Optional[int] = ..., samples_consumed: _Optional[int] = ..., messages_consumed: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., duplicates_dropped: _Optional[int] = ..., invalid_dropped: _Optional[int] = ..., max_policy_lag: _Optional[int] = ..., last_update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
