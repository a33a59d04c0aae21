# Generated from protos/ by scripts/gen_protos.py. Do not edit.
import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rlfleet.common.v1 import tensor_pb2 as _tensor_pb2
from rlfleet.reward.v1 import reward_pb2 as _reward_pb2
from rlfleet.sampler.v1 import sampler_pb2 as _sampler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutFragment(_message.Message):
    __slots__ = ("run", "actor_id", "fragment_id", "sequence", "policy_version", "num_steps", "num_envs", "observations", "actions", "logprobs", "values", "rewards", "terminated", "truncated", "next_observations", "bootstrap_values", "final_indices", "final_observations", "final_values", "episode_ids", "env_id", "env_address", "env_session_id", "create_time")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    NEXT_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_VALUES_FIELD_NUMBER: _ClassVar[int]
    FINAL_INDICES_FIELD_NUMBER: _ClassVar[int]
    FINAL_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    FINAL_VALUES_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENV_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    run: str
    actor_id: str
    fragment_id: str
    sequence: int
    policy_version: int
    num_steps: int
    num_envs: int
    observations: _tensor_pb2.TensorTree
    actions: _tensor_pb2.TensorTree
    logprobs: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    rewards: _tensor_pb2.Tensor
    terminated: _tensor_pb2.Tensor
    truncated: _tensor_pb2.Tensor
    next_observations: _tensor_pb2.TensorTree
    bootstrap_values: _tensor_pb2.Tensor
    final_indices: _tensor_pb2.Tensor
    final_observations: _tensor_pb2.TensorTree
    final_values: _tensor_pb2.Tensor
    episode_ids: _tensor_pb2.Tensor
    env_id: str
    env_address: str
    env_session_id: str
    create_time: _timestamp_pb2.Timestamp
    def __init__(self, run: _Optional[str] = ..., actor_id: _Optional[str] = ..., fragment_id: _Optional[str] = ..., sequence: _Optional[int] = ..., policy_version: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_envs: _Optional[int] = ..., observations: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., actions: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rewards: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., next_observations: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., bootstrap_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., final_indices: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., final_observations: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., final_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., episode_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., env_id: _Optional[str] = ..., env_address: _Optional[str] = ..., env_session_id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("run", "group_id", "prompt_id", "prompt_token_ids", "prompt_text", "completions", "policy_version", "source", "dataset", "create_time", "image_sha256")
    RUN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SHA256_FIELD_NUMBER: _ClassVar[int]
    run: str
    group_id: str
    prompt_id: str
    prompt_token_ids: _tensor_pb2.Tensor
    prompt_text: str
    completions: _containers.RepeatedCompositeFieldContainer[TrajectoryCompletion]
    policy_version: int
    source: str
    dataset: str
    create_time: _timestamp_pb2.Timestamp
    image_sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prompt_text: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[TrajectoryCompletion, _Mapping]]] = ..., policy_version: _Optional[int] = ..., source: _Optional[str] = ..., dataset: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., image_sha256: _Optional[_Iterable[str]] = ...) -> None: ...

class TrajectoryCompletion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "loss_mask", "finish_reason", "rewards", "reward", "policy_version", "end_policy_version", "expert", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    END_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _tensor_pb2.Tensor
    logprobs: _tensor_pb2.Tensor
    loss_mask: _tensor_pb2.Tensor
    finish_reason: _sampler_pb2.FinishReason
    rewards: _containers.RepeatedCompositeFieldContainer[_reward_pb2.FunctionScore]
    reward: float
    policy_version: int
    end_policy_version: int
    expert: bool
    text: str
    def __init__(self, token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., loss_mask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., finish_reason: _Optional[_Union[_sampler_pb2.FinishReason, str]] = ..., rewards: _Optional[_Iterable[_Union[_reward_pb2.FunctionScore, _Mapping]]] = ..., reward: _Optional[float] = ..., policy_version: _Optional[int] = ..., end_policy_version: _Optional[int] = ..., expert: _Optional[bool] = ..., text: _Optional[str] = ...) -> None: ...

class PromptTask(_message.Message):
    __slots__ = ("run", "prompt_id", "dataset", "epoch", "text", "chat", "extra")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    run: str
    prompt_id: str
    dataset: str
    epoch: int
    text: str
    chat: _sampler_pb2.ChatPrompt
    extra: _struct_pb2.Struct
    def __init__(self, run: _Optional[str] = ..., prompt_id: _Optional[str] = ..., dataset: _Optional[str] = ..., epoch: _Optional[int] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_sampler_pb2.ChatPrompt, _Mapping]] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class PayloadRef(_message.Message):
    __slots__ = ("bucket", "object", "message_type", "size", "sha256")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    object: str
    message_type: str
    size: int
    sha256: str
    def __init__(self, bucket: _Optional[str] = ..., object: _Optional[str] = ..., message_type: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...
