"""Agent sessions of the gateway's training mode: every call an agent makes, recorded token in,
token out, and the groups of sessions that go to the learner.

A session is one episode of an agent program: it starts with a task (``SessionBook.start``: the
task is handed to `group_size` sessions, as a GRPO group is G completions of one prompt), makes
chat calls tagged with its id, and ends with the reward the agent reports. Its calls are laid out
as one multi-turn episode (clients.env.episodes.Episode): the first call's prompt as the sampler
rendered it, then per call the model's tokens and logprobs exactly as sampled (under the loss
mask) and the tokens of whatever the agent added before its next call (tool results, the next
user turn; outside it). The next call's prompt continues from those tokens
(``ChatPrompt.prefix_token_ids``) when the agent sends back the conversation so far unchanged,
so the history is never re-tokenized; an agent that rewrites its history starts the episode
over from that call (counted: the earlier calls are not trained on).

A group is complete when every session of its task is rewarded or dropped (no reward within
`session_timeout_s`, a runner gone). A session at its call or token cap may not call the model
again (410) but is still rewarded: a runaway agent is stopped, its episode kept. Its rewarded
sessions are published as one TrajectoryGroup whose id is the task's (exactly once: a task
redelivered after a crash yields the same id), then the task is acked; a group with no rewarded
session is acked without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clients.env.episodes import Episode
from gateway.errors import ApiError
from rlfleet.bus.v1 import trajectory_pb2

__all__ = [
    "SESSION_HEADER",
    "AgentSession",
    "Call",
    "SessionBook",
    "SessionEnded",
    "SessionError",
    "SessionLimits",
    "TaskGroup",
]

log = logging.getLogger(__name__)

# Where a call names its session: this header, or else the request's `user` field.
SESSION_HEADER = "x-rlfleet-session"
SESSION_PARAM = "X-Rlfleet-Session"

# Why a session ended without a reward (the `dropped` counts' labels).
TIMEOUT, CALL_CAP, TOKEN_CAP, CLOSED = "timeout", "max_calls", "max_tokens", "closed"
RUNNER_RESTARTED = "runner_restarted"
REWARDED = "rewarded"
MAX_ENDED = 100_000  # ended sessions remembered (for 409/410 rather than 404)


class SessionError(ApiError):
    """A request about a session that cannot be served (an OpenAI-shaped error, ``status``)."""

    type = "invalid_request_error"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message, status=status, param=SESSION_PARAM, code="session")


class SessionEnded(SessionError):
    """The session is over (rewarded or dropped): 410 Gone."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 410)


@dataclass(frozen=True)
class SessionLimits:
    session_timeout_s: float = 600.0  # from the session's start to its reward
    max_calls: int = 32  # model calls per session: a runaway agent is cut off here
    max_tokens: int = 4096  # the episode's tokens (every prompt and completion) per session


@dataclass(frozen=True)
class Call:
    """One recorded model call: what the engine saw and what it sampled."""

    prompt_ids: list[int]  # the whole prompt, as StreamStart said
    token_ids: list[int]  # the completion's tokens
    logprobs: list[float]  # one per completion token
    version: int  # weights that sampled it
    finish_reason: int  # sampler_pb2.FinishReason


@dataclass
class TaskGroup:
    """The sessions of one task."""

    delivery: Any  # the prompt queue's Delivery of the task (acked once the group is out)
    size: int
    sessions: list[AgentSession] = field(default_factory=list)

    @property
    def task(self) -> trajectory_pb2.PromptTask:
        return self.delivery.message  # type: ignore[no-any-return]

    @property
    def full(self) -> bool:
        return len(self.sessions) >= self.size

    @property
    def settled(self) -> bool:
        return self.full and all(s.ended for s in self.sessions)


@dataclass
class AgentSession:
    """One agent episode (see the module docstring)."""

    id: str
    group: TaskGroup
    deadline: float  # time.monotonic() after which it is dropped unrewarded
    limits: SessionLimits
    episode: Episode | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # what the episode holds
    tools: list[dict[str, Any]] | None = None  # offered at the episode's first call
    calls: int = 0
    restarts: int = 0  # times the agent rewrote its history (the episode started over)
    reward: float | None = None
    dropped: str = ""  # why it ended unrewarded
    busy: bool = False  # a call is in flight
    runner: str = ""  # the program that started it, as it said (with its incarnation)
    incarnation: str = ""

    @property
    def ended(self) -> bool:
        return self.reward is not None or bool(self.dropped)

    def check_open(self) -> None:
        """May the session call the model again? (SessionEnded says why not.)"""
        if self.reward is not None:
            raise SessionEnded(f"session {self.id} was rewarded; start a new one")
        if self.dropped:
            raise SessionEnded(f"session {self.id} was dropped ({self.dropped})")
        cap = self.over_cap()
        if cap:
            raise SessionEnded(
                f"session {self.id} reached its {cap} cap: no more calls, report its reward"
            )

    def prefix(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], int] | None:
        """(token ids, message count) the next prompt continues from, or None to render it
        whole: the episode's tokens, when ``messages`` begin with the conversation it holds
        and offer the same tools."""
        if self.episode is None or tools != self.tools or len(messages) <= len(self.messages):
            return None
        if not all(same_message(a, b) for a, b in zip(messages, self.messages, strict=False)):
            return None
        return self.episode.prompt_ids + self.episode.token_ids, len(self.messages)

    def record(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        continued: bool,
        call: Call,
        reply: dict[str, Any],
    ) -> None:
        """Add a finished call: ``continued`` when its prompt was built on the episode's tokens
        (``prefix``), else it starts the episode (over)."""
        self.calls += 1
        if continued and self.episode is not None:
            held = len(self.episode.prompt_ids) + len(self.episode.token_ids)
            self.episode.add(call.prompt_ids[held:])  # what the agent added: not the model's
        else:
            if self.episode is not None:
                self.restarts += 1
            self.episode = Episode(0, prompt_ids=list(call.prompt_ids), messages=[])
            self.tools = tools
            self.episode.first_version = call.version
        episode = self.episode
        episode.add(call.token_ids, call.logprobs)
        episode.last_version = call.version
        episode.finish_reason = call.finish_reason
        episode.turns += 1
        self.messages = [*messages, reply]
        episode.messages = list(self.messages)

    def over_cap(self) -> str:
        """The cap the session has reached ("" while under them all): it may not call the
        model again, but its reward still counts."""
        if self.calls >= self.limits.max_calls:
            return CALL_CAP
        if self.episode is not None and self.episode.length >= self.limits.max_tokens:
            return TOKEN_CAP
        return ""


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether an agent sent back a message as the episode holds it (content, calls, ids)."""

    def calls(message: dict[str, Any]) -> list[tuple[str, Any, str]]:
        out = []
        for call in message.get("tool_calls") or []:
            function = call.get("function") or call
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with contextlib.suppress(ValueError):  # text that is not JSON stays text
                    arguments = json.loads(arguments)
            out.append((function.get("name"), arguments, call.get("id", "")))
        return out

    return (
        a.get("role") == b.get("role")
        and (a.get("content") or "") == (b.get("content") or "")
        and calls(a) == calls(b)
        and (a.get("tool_call_id") or "") == (b.get("tool_call_id") or "")
    )


TakeTask = Callable[[], Awaitable[Any]]  # the next task's Delivery (waits for pacing and a task)
Publish = Callable[[TaskGroup, list[AgentSession]], Awaitable[None]]  # out, then ack the task


class SessionBook:
    """Every open session and group of one gateway (see the module docstring)."""

    def __init__(
        self,
        group_size: int,
        limits: SessionLimits,
        take_task: TakeTask,
        publish: Publish,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group_size = group_size
        self.limits = limits
        self._take_task = take_task
        self._publish = publish
        self._clock = clock
        self.sessions: dict[str, AgentSession] = {}
        self._open: TaskGroup | None = None  # the group still handing out sessions
        self._opening = asyncio.Lock()
        self.counts: dict[str, int] = {"started": 0, "rewarded": 0, "groups": 0, "restarts": 0}
        self.dropped: dict[str, int] = {}
        self.capped: dict[str, int] = {}  # sessions that reached a cap, by cap
        self._incarnations: dict[str, str] = {}  # runner -> its latest incarnation
        # Sessions whose group went out, and how they ended: a late call or reward is told so.
        self._ended: OrderedDict[str, str] = OrderedDict()
        self.empty_groups = 0

    async def start(self, runner: str = "", incarnation: str = "") -> AgentSession:
        """A new session of the open group's task (a new task when it is full). A ``runner``
        that comes back as a new ``incarnation`` (restarted after a crash) had its older
        sessions cut short: they are dropped now rather than at their deadline."""
        if runner:
            before = self._incarnations.get(runner)
            self._incarnations[runner] = incarnation
            if before is not None and before != incarnation:
                for old in list(self.sessions.values()):
                    if old.runner == runner and old.incarnation == before:
                        await self.drop(old, RUNNER_RESTARTED)
        async with self._opening:
            if self._open is None or self._open.full:
                self._open = TaskGroup(await self._take_task(), self.group_size)
            group = self._open
            session = AgentSession(
                id=f"sess-{secrets.token_hex(12)}",
                group=group,
                deadline=self._clock() + self.limits.session_timeout_s,
                limits=self.limits,
                runner=runner,
                incarnation=incarnation,
            )
            group.sessions.append(session)
            self.sessions[session.id] = session
            self.counts["started"] += 1
            return session

    def get(self, session_id: str) -> AgentSession:
        session = self.sessions.get(session_id)
        if session is None:
            ended = self._ended.get(session_id)
            if ended is not None:
                raise SessionEnded(f"session {session_id} ended ({ended}); start a new one")
            raise SessionError(f"no session {session_id!r} (start one first)", 404)
        return session

    async def reward(self, session_id: str, value: float) -> AgentSession:
        """Record a session's reward, once; its group goes out when it is the last."""
        if not math.isfinite(value):
            raise SessionError(f"the reward must be a finite number, got {value}", 400)
        if self._ended.get(session_id) == REWARDED:
            raise SessionError(f"session {session_id} is already rewarded", 409)
        session = self.get(session_id)
        if session.reward is not None:
            raise SessionError(f"session {session_id} is already rewarded", 409)
        if session.dropped:
            raise SessionEnded(f"session {session_id} was dropped ({session.dropped})")
        if session.episode is None:
            raise SessionError(f"session {session_id} made no model call to reward", 409)
        session.reward = value
        session.episode.rewards.append(value)
        self.counts["rewarded"] += 1
        await self._settle(session.group)
        return session

    async def drop(self, session: AgentSession, why: str) -> None:
        """End a session unrewarded (its runner gone, a cap reached, no reward in time)."""
        if session.ended:
            return
        session.dropped = why
        self.dropped[why] = self.dropped.get(why, 0) + 1
        await self._settle(session.group)

    async def after_call(self, session: AgentSession) -> None:
        """A call was recorded: a session at a cap is counted once (its next call is refused)."""
        why = session.over_cap()
        if why:
            self.capped[why] = self.capped.get(why, 0) + 1

    async def sweep(self) -> None:
        """Drop the sessions past their deadline (no reward in time)."""
        now = self._clock()
        for session in list(self.sessions.values()):
            if not session.ended and not session.busy and now >= session.deadline:
                await self.drop(session, TIMEOUT)

    async def _settle(self, group: TaskGroup) -> None:
        if not group.settled:
            return
        if group is self._open:
            self._open = None
        for session in group.sessions:
            self.sessions.pop(session.id, None)
            self.counts["restarts"] += session.restarts
            state = REWARDED if session.reward is not None else f"dropped: {session.dropped}"
            self._ended[session.id] = state
            if len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
        rewarded = [s for s in group.sessions if s.reward is not None]
        if not rewarded:
            self.empty_groups += 1
        else:
            self.counts["groups"] += 1
        await self._publish(group, rewarded)
