"""Tool calls of an assistant message, and running a tool within a time limit.

A model trained on a chat template that declares tools (Qwen2 / Hermes style) writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in its text; a server that parsed them
already (an OpenAI-style ``tool_calls`` list on the message) is taken as it is. A call that cannot
be read is kept with its error, so the environment can answer it with a tool message saying what
was wrong instead of ignoring it: the model learns from that answer.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from env_server.text.base import Message

__all__ = ["ThreadCall", "ToolCall", "run_tool", "tool_calls", "tool_message"]

_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
MAX_CALLS_PER_TURN = 8  # more calls than this in one turn are answered with an error


@dataclass(frozen=True)
class ToolCall:
    id: str  # the message's tool_call id, or call-<turn index> for calls read from the text
    name: str  # "" when the call named no function
    arguments: dict[str, Any]
    error: str | None = None  # why the call could not be read; then arguments are {}


def _read(call_id: str, raw: str | dict[str, Any]) -> ToolCall:
    try:
        body = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        return ToolCall(call_id, "", {}, f"the tool call is not JSON: {exc}")
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return ToolCall(call_id, "", {}, 'a tool call is {"name": ..., "arguments": {...}}')
    arguments = body.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            return ToolCall(call_id, body["name"], {}, f"arguments are not JSON: {exc}")
    if not isinstance(arguments, dict):
        return ToolCall(call_id, body["name"], {}, "arguments must be a JSON object")
    return ToolCall(call_id, body["name"], arguments)


def tool_calls(message: Message) -> list[ToolCall]:
    """The calls an assistant message makes: its ``tool_calls`` when present, else the
    ``<tool_call>`` blocks of its content (an unterminated last block counts: the model may be
    cut off by its token limit)."""
    listed = message.get("tool_calls") or []
    if listed:
        return [
            _read(str(call.get("id") or f"call-{i}"), call.get("function") or call)
            for i, call in enumerate(listed)
        ]
    content = message.get("content") or ""
    return [_read(f"call-{i}", raw.strip()) for i, raw in enumerate(_HERMES_CALL.findall(content))]


def tool_message(call: ToolCall, content: dict[str, Any]) -> Message:
    """The tool message answering ``call`` (content as JSON, how chat templates show results)."""
    return {
        "role": "tool",
        "tool_call_id": call.id,
        "name": call.name,
        "content": json.dumps(content, sort_keys=True),
    }


class ThreadCall:
    """``call()`` in a daemon thread of its own (one that hangs is left behind: a thread cannot
    be stopped); `outcome` is ("ok", value), ("error", exception) or ("timeout", None)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._box: dict[str, Any] = {}
        self._call = call
        self._worker = threading.Thread(target=self._run, name="text-env-call", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        try:
            self._box["ok"] = self._call()
        except Exception as exc:  # the caller decides what an env's or tool's error means
            self._box["error"] = exc

    def outcome(self, deadline: float) -> tuple[str, Any]:
        self._worker.join(max(0.0, deadline - time.monotonic()))
        if self._worker.is_alive():
            return "timeout", None
        return next(iter(self._box.items()))


def run_tool(
    function: Callable[..., Any], arguments: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """``{"result": function(**arguments)}``, or ``{"error": ...}`` when it raises or runs past
    ``timeout_s``; the episode goes on with the error (a hung tool is left behind)."""
    outcome, value = ThreadCall(functools.partial(function, **arguments)).outcome(
        time.monotonic() + timeout_s
    )
    if outcome == "timeout":
        return {"error": f"the tool did not answer within {timeout_s:g}s"}
    if outcome == "error":
        return {"error": f"{type(value).__name__}: {value}"}
    return {"result": value}
