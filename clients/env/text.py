"""Text environments over `EnvService`: messages to and from the wire, and `TextSession`.

A text session is a Session stream like any other (the same limits, in-band errors and idle
timeout); its pool answers with chat messages instead of tensors (env.proto: EnvKind,
ChatMessage, TextTurn). The server keeps each episode's state: a client sends only the model's
turn and gets back what the environment says.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2

from clients.env.session import EnvSession
from clients.env.types import EnvEntry, EpisodeStats, Message, TextStepResult, TextTurn
from common import tensor
from rlfleet.env.v1 import env_pb2
from services.errors import InvalidArgument

__all__ = [
    "DEMONSTRATE",
    "TextSession",
    "TextSessionInfo",
    "info_struct",
    "message_from_proto",
    "message_to_proto",
    "turn_from_proto",
    "turn_to_proto",
]

# Reset option the env server handles itself (not passed to the env): each env's expert plays
# its episode at once, returned in the info (``demonstration``, ``demonstration_return``).
DEMONSTRATE = "demonstrate"


def message_to_proto(message: Message) -> env_pb2.ChatMessage:
    """A chat message dict as a ChatMessage; InvalidArgument naming what is not one."""
    if not isinstance(message, dict):
        raise InvalidArgument(f"a chat message is a dict, got {type(message).__name__}")
    out = env_pb2.ChatMessage(
        role=str(message.get("role") or ""),
        content=str(message.get("content") or ""),
        tool_call_id=str(message.get("tool_call_id") or ""),
        name=str(message.get("name") or ""),
    )
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or call
        arguments = function.get("arguments", {})
        out.tool_calls.add(
            id=str(call.get("id") or f"call-{i}"),
            name=str(function.get("name") or ""),
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )
    return out


def message_from_proto(msg: env_pb2.ChatMessage) -> Message:
    """A ChatMessage as the dict chat templates take (fields left empty are left out)."""
    message: Message = {"role": msg.role, "content": msg.content}
    if msg.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in msg.tool_calls
        ]
    if msg.tool_call_id:
        message["tool_call_id"] = msg.tool_call_id
    if msg.name:
        message["name"] = msg.name
    return message


def _plain(value: Any) -> Any:
    """A JSON-like value for a Struct: non-finite numbers and unknown types written as text."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def info_struct(info: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(_plain(info))
    return struct


def turn_to_proto(turn: TextTurn) -> env_pb2.TextTurn:
    return env_pb2.TextTurn(
        env_index=turn.env_index,
        messages=[message_to_proto(m) for m in turn.messages],
        info=info_struct(turn.info),
    )


def turn_from_proto(msg: env_pb2.TextTurn) -> TextTurn:
    info = json_format.MessageToDict(msg.info)
    # Struct numbers are doubles: integral ones come back as ints (turn counts, answers).
    info = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in info.items()}
    return TextTurn(msg.env_index, [message_from_proto(m) for m in msg.messages], info)


@dataclass(frozen=True)
class TextSessionInfo:
    """What CreateRequest answered for a text pool."""

    session_id: str
    env: EnvEntry
    num_envs: int
    tools: list[dict[str, Any]]  # OpenAI function tools the env offers


class TextSession:
    """One Session stream on a pool of text environments: create, reset/step, close.

    Episodes move at their own pace: `step` names the envs whose turn it is, and an env whose
    episode ended waits for `reset` (autoreset is off for text pools).
    """

    def __init__(self, address: str, *, request_timeout_s: float = 120.0) -> None:
        self._session = EnvSession(address, request_timeout_s=request_timeout_s)
        self.address = address
        self.info: TextSessionInfo | None = None

    async def __aenter__(self) -> TextSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def create(
        self,
        env_id: str,
        num_envs: int = 1,
        *,
        seed: int | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> TextSessionInfo:
        request = env_pb2.CreateRequest(
            env_id=env_id,
            num_envs=num_envs,
            seed=seed,
            autoreset_mode=env_pb2.AUTORESET_MODE_DISABLED,
        )
        if kwargs:
            request.kwargs.update(kwargs)
        msg = (await self._session._request(create=request)).create
        env = EnvEntry.from_proto(msg.env)
        if env.kind != "text":
            await self.close()
            raise InvalidArgument(
                f"{env_id} is a {env.kind} environment, not a text one: use EnvSession",
                field="create.env_id",
            )
        tools = [json_format.MessageToDict(tool) for tool in msg.tools]
        self.info = TextSessionInfo(msg.session_id, env, msg.num_envs, tools)
        return self.info

    async def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        env_indices: Sequence[int] = (),
        options: dict[str, Any] | None = None,
    ) -> list[TextTurn]:
        """Reset all envs (or ``env_indices``); env i gets seed + i, or the k-th its own
        ``seed[k]``. Returns the messages that open each episode."""
        request = env_pb2.ResetRequest(env_indices=list(env_indices))
        if isinstance(seed, Sequence):
            request.seeds.extend(-1 if s is None else int(s) for s in seed)
        elif seed is not None:
            request.seed = int(seed)
        if options is not None:
            request.options.update(options)
        msg = (await self._session._request(reset=request)).reset
        return [turn_from_proto(t) for t in msg.texts]

    async def step(
        self, messages: Sequence[Message], env_indices: Sequence[int] = ()
    ) -> TextStepResult:
        """Step ``env_indices`` (all when empty) with one assistant message each."""
        request = env_pb2.StepRequest(
            text_actions=[message_to_proto(m) for m in messages], env_indices=list(env_indices)
        )
        msg = (await self._session._request(step=request)).step
        turns = [turn_from_proto(t) for t in msg.texts]
        return TextStepResult(
            env_indices=[t.env_index for t in turns],
            rewards=[float(r) for r in _decoded(msg.rewards)],
            terminated=[bool(t) for t in _decoded(msg.terminated)],
            truncated=[bool(t) for t in _decoded(msg.truncated)],
            turns=turns,
            episodes=[
                EpisodeStats(e.env_index, e.episode_return, e.length, e.truncated)
                for e in msg.episodes
            ],
        )

    async def close(self) -> int:
        """Close the pool and the stream; the session's total env steps. Idempotent."""
        return await self._session.close()


def _decoded(msg: Any) -> Any:
    return tensor.decode(msg)
