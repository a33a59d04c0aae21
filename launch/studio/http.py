"""The studio's request and error handling, shared by its routes (launch/studio/app.py,
launch/studio/tasks.py)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.errors import ConfigError, FailedPrecondition, NotFound, RlfleetError

__all__ = ["BadRequest", "error_response", "handled", "json_body", "text_field"]

MAX_BODY_BYTES = 1 << 20  # a run file is a few KB
_STATUS = {NotFound: 404, FailedPrecondition: 409, ConfigError: 422}


class BadRequest(ValueError):
    pass


def error_response(exc: Exception) -> JSONResponse:
    """The JSON error for ``exc`` (see the module doc)."""
    if isinstance(exc, BadRequest):
        return JSONResponse({"detail": str(exc)}, status_code=400)
    assert isinstance(exc, RlfleetError)
    status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 500)
    body: dict[str, Any] = {"detail": exc.message}
    if isinstance(exc, ConfigError):
        body["issues"] = [issue._asdict() for issue in exc.issues]
    return JSONResponse(body, status_code=status)


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; BadRequest naming what is wrong."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body of {len(raw)} bytes, over {MAX_BODY_BYTES}")
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data


def text_field(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string (the run file's YAML)")
    return value


Handler = Callable[[Request], Awaitable[Response]]


def handled(fn: Handler) -> Handler:
    """``fn`` with rlfleet's errors and bad requests turned into JSON errors."""

    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except (BadRequest, NotFound, FailedPrecondition, ConfigError) as exc:
            return error_response(exc)

    return wrapper
