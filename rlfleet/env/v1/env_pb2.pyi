# Generated from protos/ by scripts/gen_protos.py. Do not edit.
from google.protobuf import struct_pb2 as _struct_pb2
from google.rpc import status_pb2 as _status_pb2
from rlfleet.common.v1 import space_pb2 as _space_pb2
from rlfleet.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AutoresetMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUTORESET_MODE_UNSPECIFIED: _ClassVar[AutoresetMode]
    AUTORESET_MODE_SAME_STEP: _ClassVar[AutoresetMode]
    AUTORESET_MODE_NEXT_STEP: _ClassVar[AutoresetMode]
    AUTORESET_MODE_DISABLED: _ClassVar[AutoresetMode]

class EnvKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENV_KIND_UNSPECIFIED: _ClassVar[EnvKind]
    ENV_KIND_TENSOR: _ClassVar[EnvKind]
    ENV_KIND_TEXT: _ClassVar[EnvKind]
AUTORESET_MODE_UNSPECIFIED: AutoresetMode
AUTORESET_MODE_SAME_STEP: AutoresetMode
AUTORESET_MODE_NEXT_STEP: AutoresetMode
AUTORESET_MODE_DISABLED: AutoresetMode
ENV_KIND_UNSPECIFIED: EnvKind
ENV_KIND_TENSOR: EnvKind
ENV_KIND_TEXT: EnvKind

class ListEnvsRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: str
    def __init__(self, filter: _Optional[str] = ...) -> None: ...

class ListEnvsResponse(_message.Message):
    __slots__ = ("envs",)
    ENVS_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.RepeatedCompositeFieldContainer[EnvInfo]
    def __init__(self, envs: _Optional[_Iterable[_Union[EnvInfo, _Mapping]]] = ...) -> None: ...

class EnvInfo(_message.Message):
    __slots__ = ("env_id", "source", "max_episode_steps", "reward_threshold", "kind")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    REWARD_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    source: str
    max_episode_steps: int
    reward_threshold: float
    kind: EnvKind
    def __init__(self, env_id: _Optional[str] = ..., source: _Optional[str] = ..., max_episode_steps: _Optional[int] = ..., reward_threshold: _Optional[float] = ..., kind: _Optional[_Union[EnvKind, str]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("request_id", "create", "reset", "step", "render", "close", "colocate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RENDER_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    COLOCATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    create: CreateRequest
    reset: ResetRequest
    step: StepRequest
    render: RenderRequest
    close: CloseRequest
    colocate: ColocateRequest
    def __init__(self, request_id: _Optional[int] = ..., create: _Optional[_Union[CreateRequest, _Mapping]] = ..., reset: _Optional[_Union[ResetRequest, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ..., render: _Optional[_Union[RenderRequest, _Mapping]] = ..., close: _Optional[_Union[CloseRequest, _Mapping]] = ..., colocate: _Optional[_Union[ColocateRequest, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("request_id", "error", "create", "reset", "step", "render", "close", "colocate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RENDER_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    COLOCATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: _status_pb2.Status
    create: CreateResponse
    reset: ResetResponse
    step: StepResponse
    render: RenderResponse
    close: CloseResponse
    colocate: ColocateResponse
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., create: _Optional[_Union[CreateResponse, _Mapping]] = ..., reset: _Optional[_Union[ResetResponse, _Mapping]] = ..., step: _Optional[_Union[StepResponse, _Mapping]] = ..., render: _Optional[_Union[RenderResponse, _Mapping]] = ..., close: _Optional[_Union[CloseResponse, _Mapping]] = ..., colocate: _Optional[_Union[ColocateResponse, _Mapping]] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("env_id", "num_envs", "seed", "kwargs", "autoreset_mode", "render_mode", "float64_rewards")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    AUTORESET_MODE_FIELD_NUMBER: _ClassVar[int]
    RENDER_MODE_FIELD_NUMBER: _ClassVar[int]
    FLOAT64_REWARDS_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    num_envs: int
    seed: int
    kwargs: _struct_pb2.Struct
    autoreset_mode: AutoresetMode
    render_mode: str
    float64_rewards: bool
    def __init__(self, env_id: _Optional[str] = ..., num_envs: _Optional[int] = ..., seed: _Optional[int] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., autoreset_mode: _Optional[_Union[AutoresetMode, str]] = ..., render_mode: _Optional[str] = ..., float64_rewards: _Optional[bool] = ...) -> None: ...

class CreateResponse(_message.Message):
    __slots__ = ("session_id", "observation_space", "action_space", "num_envs", "autoreset_mode", "env", "render_modes", "render_fps", "tools")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    AUTORESET_MODE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    RENDER_MODES_FIELD_NUMBER: _ClassVar[int]
    RENDER_FPS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    observation_space: _space_pb2.Space
    action_space: _space_pb2.Space
    num_envs: int
    autoreset_mode: AutoresetMode
    env: EnvInfo
    render_modes: _containers.RepeatedScalarFieldContainer[str]
    render_fps: float
    tools: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    def __init__(self, session_id: _Optional[str] = ..., observation_space: _Optional[_Union[_space_pb2.Space, _Mapping]] = ..., action_space: _Optional[_Union[_space_pb2.Space, _Mapping]] = ..., num_envs: _Optional[int] = ..., autoreset_mode: _Optional[_Union[AutoresetMode, str]] = ..., env: _Optional[_Union[EnvInfo, _Mapping]] = ..., render_modes: _Optional[_Iterable[str]] = ..., render_fps: _Optional[float] = ..., tools: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("seed", "env_indices", "options", "seeds")
    SEED_FIELD_NUMBER: _ClassVar[int]
    ENV_INDICES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    seed: int
    env_indices: _containers.RepeatedScalarFieldContainer[int]
    options: _struct_pb2.Struct
    seeds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seed: _Optional[int] = ..., env_indices: _Optional[_Iterable[int]] = ..., options: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., seeds: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("observations", "infos", "texts")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    INFOS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    observations: _tensor_pb2.TensorTree
    infos: _tensor_pb2.TensorTree
    texts: _containers.RepeatedCompositeFieldContainer[TextTurn]
    def __init__(self, observations: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., infos: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., texts: _Optional[_Iterable[_Union[TextTurn, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("actions", "text_actions", "env_indices")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    ENV_INDICES_FIELD_NUMBER: _ClassVar[int]
    actions: _tensor_pb2.TensorTree
    text_actions: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    env_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, actions: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., text_actions: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., env_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observations", "rewards", "terminated", "truncated", "final_observations", "infos", "episodes", "texts")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FINAL_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    INFOS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    observations: _tensor_pb2.TensorTree
    rewards: _tensor_pb2.Tensor
    terminated: _tensor_pb2.Tensor
    truncated: _tensor_pb2.Tensor
    final_observations: _tensor_pb2.TensorTree
    infos: _tensor_pb2.TensorTree
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeEnd]
    texts: _containers.RepeatedCompositeFieldContainer[TextTurn]
    def __init__(self, observations: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., rewards: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., final_observations: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., infos: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., episodes: _Optional[_Iterable[_Union[EpisodeEnd, _Mapping]]] = ..., texts: _Optional[_Iterable[_Union[TextTurn, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class TextTurn(_message.Message):
    __slots__ = ("env_index", "messages", "info")
    ENV_INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    env_index: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    info: _struct_pb2.Struct
    def __init__(self, env_index: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class EpisodeEnd(_message.Message):
    __slots__ = ("env_index", "episode_return", "length", "truncated", "score")
    ENV_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPISODE_RETURN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    env_index: int
    episode_return: float
    length: int
    truncated: bool
    score: float
    def __init__(self, env_index: _Optional[int] = ..., episode_return: _Optional[float] = ..., length: _Optional[int] = ..., truncated: _Optional[bool] = ..., score: _Optional[float] = ...) -> None: ...

class RenderRequest(_message.Message):
    __slots__ = ("env_indices",)
    ENV_INDICES_FIELD_NUMBER: _ClassVar[int]
    env_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, env_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class RenderResponse(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _tensor_pb2.Tensor
    def __init__(self, frames: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("total_steps",)
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    total_steps: int
    def __init__(self, total_steps: _Optional[int] = ...) -> None: ...

class ColocateRequest(_message.Message):
    __slots__ = ("host_id", "segment_name", "segment_bytes", "slots", "doorbell")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    segment_name: str
    segment_bytes: int
    slots: int
    doorbell: str
    def __init__(self, host_id: _Optional[str] = ..., segment_name: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., slots: _Optional[int] = ..., doorbell: _Optional[str] = ...) -> None: ...

class ColocateResponse(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
