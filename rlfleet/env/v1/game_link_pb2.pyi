# Generated from protos/ by scripts/gen_protos.py. Do not edit.
from google.rpc import status_pb2 as _status_pb2
from rlfleet.common.v1 import space_pb2 as _space_pb2
from rlfleet.common.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConnectRequest(_message.Message):
    __slots__ = ("request_id", "hello", "observations", "goodbye")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    hello: Hello
    observations: ObservationBatch
    goodbye: Goodbye
    def __init__(self, request_id: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., observations: _Optional[_Union[ObservationBatch, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("request_id", "error", "welcome", "actions", "farewell")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    FAREWELL_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: _status_pb2.Status
    welcome: Welcome
    actions: ActionReply
    farewell: Farewell
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., actions: _Optional[_Union[ActionReply, _Mapping]] = ..., farewell: _Optional[_Union[Farewell, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("game", "env_id", "observation_space", "action_space", "num_agents", "protocol_version", "session_key", "max_in_flight", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GAME_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_AGENTS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    game: str
    env_id: str
    observation_space: _space_pb2.Space
    action_space: _space_pb2.Space
    num_agents: int
    protocol_version: int
    session_key: str
    max_in_flight: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, game: _Optional[str] = ..., env_id: _Optional[str] = ..., observation_space: _Optional[_Union[_space_pb2.Space, _Mapping]] = ..., action_space: _Optional[_Union[_space_pb2.Space, _Mapping]] = ..., num_agents: _Optional[int] = ..., protocol_version: _Optional[int] = ..., session_key: _Optional[str] = ..., max_in_flight: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("link_id", "protocol_version", "max_in_flight", "resumed", "last_tick", "resume_window_s", "run", "policy_version", "policy_loaded", "policy")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    LAST_TICK_FIELD_NUMBER: _ClassVar[int]
    RESUME_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_LOADED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    protocol_version: int
    max_in_flight: int
    resumed: bool
    last_tick: int
    resume_window_s: float
    run: str
    policy_version: int
    policy_loaded: bool
    policy: str
    def __init__(self, link_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., resumed: _Optional[bool] = ..., last_tick: _Optional[int] = ..., resume_window_s: _Optional[float] = ..., run: _Optional[str] = ..., policy_version: _Optional[int] = ..., policy_loaded: _Optional[bool] = ..., policy: _Optional[str] = ...) -> None: ...

class ObservationBatch(_message.Message):
    __slots__ = ("tick", "observations", "rewards", "terminated", "truncated", "episode_ids", "infos")
    TICK_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    INFOS_FIELD_NUMBER: _ClassVar[int]
    tick: int
    observations: _tensor_pb2.TensorTree
    rewards: _tensor_pb2.Tensor
    terminated: _tensor_pb2.Tensor
    truncated: _tensor_pb2.Tensor
    episode_ids: _tensor_pb2.Tensor
    infos: _tensor_pb2.TensorTree
    def __init__(self, tick: _Optional[int] = ..., observations: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., rewards: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., episode_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., infos: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ...) -> None: ...

class ActionReply(_message.Message):
    __slots__ = ("tick", "actions", "policy_version")
    TICK_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    tick: int
    actions: _tensor_pb2.TensorTree
    policy_version: int
    def __init__(self, tick: _Optional[int] = ..., actions: _Optional[_Union[_tensor_pb2.TensorTree, _Mapping]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Farewell(_message.Message):
    __slots__ = ("ticks", "episodes")
    TICKS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    ticks: int
    episodes: int
    def __init__(self, ticks: _Optional[int] = ..., episodes: _Optional[int] = ...) -> None: ...
