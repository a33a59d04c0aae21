# Generated from protos/ by scripts/gen_protos.py. Do not edit.
import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.rpc import status_pb2 as _status_pb2
from rlfleet.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REWARD_KIND_UNSPECIFIED: _ClassVar[RewardKind]
    REWARD_KIND_RULE: _ClassVar[RewardKind]
    REWARD_KIND_PLUGIN: _ClassVar[RewardKind]
    REWARD_KIND_MODEL: _ClassVar[RewardKind]

class ScoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_STATUS_UNSPECIFIED: _ClassVar[ScoreStatus]
    SCORE_STATUS_OK: _ClassVar[ScoreStatus]
    SCORE_STATUS_ABSTAINED: _ClassVar[ScoreStatus]
    SCORE_STATUS_ERROR: _ClassVar[ScoreStatus]
REWARD_KIND_UNSPECIFIED: RewardKind
REWARD_KIND_RULE: RewardKind
REWARD_KIND_PLUGIN: RewardKind
REWARD_KIND_MODEL: RewardKind
SCORE_STATUS_UNSPECIFIED: ScoreStatus
SCORE_STATUS_OK: ScoreStatus
SCORE_STATUS_ABSTAINED: ScoreStatus
SCORE_STATUS_ERROR: ScoreStatus

class ScoreRequest(_message.Message):
    __slots__ = ("items", "rewards")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    rewards: _containers.RepeatedCompositeFieldContainer[RewardWeight]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., rewards: _Optional[_Iterable[_Union[RewardWeight, _Mapping]]] = ...) -> None: ...

class RewardWeight(_message.Message):
    __slots__ = ("name", "weight", "timeout", "kwargs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    timeout: _duration_pb2.Duration
    kwargs: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("prompt", "completion", "prompt_token_ids", "completion_token_ids", "extra")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    completion: str
    prompt_token_ids: _tensor_pb2.Tensor
    completion_token_ids: _tensor_pb2.Tensor
    extra: _struct_pb2.Struct
    def __init__(self, prompt: _Optional[str] = ..., completion: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., completion_token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results", "rewards")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ItemScore]
    rewards: _containers.RepeatedCompositeFieldContainer[RewardWeight]
    def __init__(self, results: _Optional[_Iterable[_Union[ItemScore, _Mapping]]] = ..., rewards: _Optional[_Iterable[_Union[RewardWeight, _Mapping]]] = ...) -> None: ...

class ItemScore(_message.Message):
    __slots__ = ("total", "scores")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    total: float
    scores: _containers.RepeatedCompositeFieldContainer[FunctionScore]
    def __init__(self, total: _Optional[float] = ..., scores: _Optional[_Iterable[_Union[FunctionScore, _Mapping]]] = ...) -> None: ...

class FunctionScore(_message.Message):
    __slots__ = ("name", "status", "score", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: ScoreStatus
    score: float
    error: _status_pb2.Status
    def __init__(self, name: _Optional[str] = ..., status: _Optional[_Union[ScoreStatus, str]] = ..., score: _Optional[float] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class ListRewardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRewardsResponse(_message.Message):
    __slots__ = ("rewards",)
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedCompositeFieldContainer[RewardInfo]
    def __init__(self, rewards: _Optional[_Iterable[_Union[RewardInfo, _Mapping]]] = ...) -> None: ...

class RewardInfo(_message.Message):
    __slots__ = ("name", "kind", "description", "extra_keys", "default_timeout", "default_weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RewardKind
    description: str
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    default_timeout: _duration_pb2.Duration
    default_weight: float
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RewardKind, str]] = ..., description: _Optional[str] = ..., extra_keys: _Optional[_Iterable[str]] = ..., default_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., default_weight: _Optional[float] = ...) -> None: ...
