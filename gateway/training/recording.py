"""One chat call of a training session, between the chat route and the session book: its prompt
continued from the session's tokens, what it sampled recorded when it finishes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import json_format

from common import tensor
from gateway.errors import BadRequest
from gateway.training.sessions import (
    SESSION_HEADER,
    AgentSession,
    Call,
    SessionBook,
    SessionError,
)
from rlfleet.sampler.v1 import sampler_pb2

__all__ = ["SessionCall", "reply_message", "session_call"]


def _message(m: sampler_pb2.ChatMessage) -> dict[str, Any]:
    """A request's message in the form the session keeps (what `same_message` compares)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def reply_message(content: str | None, calls: Sequence[dict[str, str]]) -> dict[str, Any]:
    """The assistant message a call answered with, in the same form (calls as
    ``{"id", "name", "arguments"}``)."""
    out: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        out["tool_calls"] = [
            {"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    return out


@dataclass
class SessionCall:
    """A call of ``session``: `prepare` its prompt, then `finish` or `release` it."""

    book: SessionBook
    session: AgentSession
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    continued: bool = False
    holding: bool = False  # this call marked the session busy

    def prepare(self, n: int, prompt: sampler_pb2.Prompt, sampling: Any) -> None:
        """Check the call, continue its prompt from the session's tokens when the agent sent
        its conversation back unchanged, and ask for the logprobs the learner needs."""
        if n != 1:
            raise BadRequest("n: a training session's call makes one completion", param="n")
        self.session.check_open()
        if self.session.busy:
            raise SessionError(f"session {self.session.id} has a call in flight", 409)
        self.messages = [_message(m) for m in prompt.chat.messages]
        self.tools = [json_format.MessageToDict(t) for t in prompt.chat.tools] or None
        prefix = self.session.prefix(self.messages, self.tools)
        if prefix is not None:
            ids, count = prefix
            prompt.chat.prefix_token_ids.CopyFrom(tensor.encode(np.asarray(ids, np.int32)))
            prompt.chat.prefix_messages = count
            self.continued = True
        sampling.logprobs = True
        self.session.busy = self.holding = True

    async def finish(
        self,
        start: sampler_pb2.StreamStart,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: int,
        reply: dict[str, Any],
    ) -> None:
        """Record what the call sampled (a session that ended meanwhile records nothing)."""
        self.release()
        if self.session.ended:
            return
        call = Call(
            prompt_ids=tensor.decode(start.prompt_token_ids).tolist(),
            token_ids=[int(i) for i in token_ids],
            logprobs=[float(x) for x in logprobs],
            version=int(start.policy_version),
            finish_reason=finish_reason,
        )
        self.session.record(self.messages, self.tools, self.continued, call, reply)
        await self.book.after_call(self.session)

    def release(self) -> None:
        """The call is over (recorded or failed): the session may call again."""
        if self.holding:
            self.session.busy = self.holding = False


def session_call(
    book: SessionBook | None, headers: Mapping[str, str], user: str | None
) -> SessionCall | None:
    """The training session a chat call belongs to, if any: an ``X-Rlfleet-Session`` header
    must name an open one (404, 410 otherwise); a ``user`` field names one only when it is a
    session id."""
    if book is None:
        return None
    named = headers.get(SESSION_HEADER)
    if named is None:
        if not user or user not in book.sessions:
            return None
        named = user
    session = book.get(named)
    session.check_open()
    return SessionCall(book, session)
