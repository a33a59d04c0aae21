"""Thin routers: authenticate, rate-limit, validate, hand over to a serving class.

Checks run in the order a client can act on: body size (413, middleware), API key (401; 429
while the client's address is locked out for wrong keys), rate limit (429), request shape (400:
the JSON itself in openai/body.py, then the protocol models), model (404), then the samplers
(400 for what they reject, 429 when every queue is full, 503 when no replica is healthy).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from gateway.errors import ApiError, BadRequest
from gateway.limits import KeyLimiter
from gateway.openai.body import parse_body
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai.serving_engine import RequestContext, SSEResponse
from gateway.training.recording import session_call

if TYPE_CHECKING:
    from gateway.app import Gateway

__all__ = ["authenticate", "param_of", "router"]

log = logging.getLogger(__name__)

router = APIRouter()
M = TypeVar("M", bound=BaseModel)


_UNION_MEMBERS = frozenset(
    {
        "str",
        "list[str]",
        "list[int]",
        "list[list[int]]",
        "list[constrained-int]",
        "list[list[constrained-int]]",
        "list[ContentPart]",
    }
)


def param_of(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location -> an OpenAI ``param`` ("messages[0].role")."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif part in _UNION_MEMBERS:
            continue  # the union member pydantic tried, not a field
        else:
            out += f".{part}"
    return out or None


def validation_error(exc: ValidationError) -> BadRequest:
    first = exc.errors()[0]
    param = param_of(tuple(first["loc"]))
    if param == "prompt" and len(exc.errors()) > 1:  # no member of the union matched
        return BadRequest(
            "prompt: must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (token ids are 32-bit integers)",
            param="prompt",
        )
    if first["loc"] and first["loc"][-1] in _UNION_MEMBERS:
        # A value no member of a union took: the member that got deepest into it says what is
        # wrong (a content part's image_url), not the first one tried (a string).
        first = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = param_of(tuple(first["loc"]))
    message = first["msg"]
    if param:
        message = f"{param}: {message}"
    more = len(exc.errors()) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return BadRequest(message, param=param)


async def parse(request: Request, model: type[M]) -> M:
    body = await request.body()
    data = parse_body(body, max_depth=gateway_of(request).limits.max_json_depth)
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    ignored = getattr(parsed, "ignored_fields", [])
    if ignored:
        log.info("ignoring unsupported fields %s", ", ".join(ignored))
    return parsed


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


def authenticate(request: Request) -> KeyLimiter:
    """The caller's key (401, or 429 while its address is locked out for wrong keys)."""
    address = request.client.host if request.client is not None else None
    return gateway_of(request).auth.authenticate(request.headers.get("authorization"), address)


def admit(request: Request, route: str) -> RequestContext:
    key = authenticate(request)
    gateway_of(request).auth.admit(key)
    return RequestContext(route=route, key=key)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    authenticate(request)
    return JSONResponse(gateway_of(request).completion.models().model_dump(mode="json"))


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    gateway = gateway_of(request)
    authenticate(request)
    for card in gateway.completion.models().data:
        if card.id == model:
            return JSONResponse(card.model_dump(mode="json"))
    from gateway.errors import ModelNotFound

    raise ModelNotFound(model)


async def serve(ctx: RequestContext, stream: bool, create: Awaitable[Response]) -> Response:
    """``create``'s response, counted in flight until it is complete: a stream's response
    (SSEResponse) finishes ``ctx`` itself when its last byte is sent."""
    ctx.begin(stream=stream)
    try:
        response = await create
    except ApiError as exc:
        ctx.finish(exc.type)
        raise
    except asyncio.CancelledError:
        ctx.finish("client_disconnected")
        raise
    except BaseException:
        ctx.finish("internal")
        raise
    if not isinstance(response, SSEResponse):
        ctx.finish()
    return response


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    ctx = admit(request, "/v1/completions")
    body = await parse(request, CompletionRequest)
    return await serve(ctx, body.stream, gateway_of(request).completion.create(body, ctx))


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    ctx = admit(request, "/v1/chat/completions")
    body = await parse(request, ChatCompletionRequest)
    gateway = gateway_of(request)
    book = gateway.training.book if gateway.training is not None else None
    session = session_call(book, request.headers, body.user)
    return await serve(ctx, body.stream, gateway.chat.create(body, ctx, session))
