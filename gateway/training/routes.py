"""The training mode's own routes, under ``/rlfleet/v1/`` and authenticated like the rest:

- ``POST /rlfleet/v1/sessions`` (optionally ``{"runner", "incarnation"}``: a runner that starts
  again as a new incarnation has its older sessions dropped at once): start a session; the
  answer names it and its task
  (``{"session_id", "task": {"prompt_id", "dataset", "prompt" | "messages", "extra"},
  "timeout_s"}``). 503 while no task can start (the queue is empty, the learner is behind).
- ``POST /rlfleet/v1/sessions/{id}/reward`` with ``{"reward": number}``: the session's reward,
  once (409 twice); its group goes to the learner when it is the last.
- ``DELETE /rlfleet/v1/sessions/{id}``: give a session up (dropped, counted).

A chat call belongs to a session when its ``X-Rlfleet-Session`` header, or else its ``user``
field, names one (gateway/training/recording.py ``session_call``; docs/agents.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from pydantic import Field

from gateway.errors import ApiError
from gateway.openai.routes import authenticate, gateway_of, parse
from gateway.training.sessions import CLOSED
from rlfleet.bus.v1 import trajectory_pb2
from services.config import StrictModel
from services.errors import Unavailable

if TYPE_CHECKING:
    from gateway.training.trainer import AgentTrainer

__all__ = ["router"]

router = APIRouter()


class StartRequest(StrictModel):
    runner: str = Field(default="", max_length=256, description="the agent program's name")
    incarnation: str = Field(
        default="", max_length=256, description="which start of that program (e.g. its pid)"
    )


class RewardRequest(StrictModel):
    reward: float = Field(description="the session's reward (a finite number)")


def _trainer(request: Request) -> AgentTrainer:
    trainer = gateway_of(request).training
    if trainer is None:
        raise ApiError(
            "this gateway is not in training mode (settings.training is null)",
            status=404,
            type="invalid_request_error",
        )
    return trainer


def task_body(task: trajectory_pb2.PromptTask) -> dict[str, Any]:
    """A task as an agent reads it."""
    body: dict[str, Any] = {"prompt_id": task.prompt_id, "dataset": task.dataset}
    if task.WhichOneof("prompt") == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in task.chat.messages]
    else:
        body["prompt"] = task.text
    body["extra"] = json_format.MessageToDict(task.extra)
    return body


@router.post("/rlfleet/v1/sessions")
async def start_session(request: Request) -> JSONResponse:
    authenticate(request)
    trainer = _trainer(request)
    raw = await request.body()
    asked = await parse(request, StartRequest) if raw.strip() else StartRequest()
    try:
        session = await trainer.book.start(asked.runner, asked.incarnation)
    except Unavailable as exc:
        raise ApiError(
            str(exc), status=503, type="service_unavailable", headers={"Retry-After": "1"}
        ) from None
    body = {
        "session_id": session.id,
        "task": task_body(session.group.task),
        "timeout_s": trainer.settings.session_timeout_s,
    }
    return JSONResponse(body)


@router.post("/rlfleet/v1/sessions/{session_id}/reward")
async def reward_session(request: Request, session_id: str) -> JSONResponse:
    authenticate(request)
    trainer = _trainer(request)
    body = await parse(request, RewardRequest)
    session = await trainer.book.reward(session_id, body.reward)
    return JSONResponse(
        {"session_id": session.id, "reward": session.reward, "calls": session.calls}
    )


@router.delete("/rlfleet/v1/sessions/{session_id}")
async def drop_session(request: Request, session_id: str) -> JSONResponse:
    authenticate(request)
    trainer = _trainer(request)
    session = trainer.book.get(session_id)
    await trainer.book.drop(session, CLOSED)
    return JSONResponse({"session_id": session.id, "dropped": session.dropped})
