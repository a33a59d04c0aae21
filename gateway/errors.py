"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a route can meet is an ``ApiError`` with its HTTP status; ``from_backend`` maps a
sampler's gRPC code (as the services.errors class the sampler client raised) onto one, and
``sampler_param`` turns the sampler's BadRequest field ("sampling.top_p") into the OpenAI
request field ("top_p").
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from services.errors import RlfleetError

__all__ = [
    "ApiError",
    "BackendUnavailable",
    "BadRequest",
    "NoBackend",
    "context_length_exceeded",
    "from_backend",
    "sampler_param",
]

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with an OpenAI error object."""

    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"


class ModelNotFound(ApiError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


class BodyTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class RateLimited(ApiError):
    status = 429

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        retry_after_s: float,
        code: str = "rate_limit_exceeded",
    ) -> None:
        super().__init__(
            message,
            code=code,
            type=kind,  # OpenAI: "requests" or "tokens"
            headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
        )


class RequestTimeout(ApiError):
    """The body did not arrive in time; the connection is closed, as what is left of the body
    would otherwise be read as the next request."""

    status = 408
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_timeout", headers={"Connection": "close"})


class Overloaded(ApiError):
    """Every replica's queue is full: retry later (gRPC RESOURCE_EXHAUSTED)."""

    status = 429
    type = "server_overloaded"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="server_overloaded", headers={"Retry-After": "1"})


class NoBackend(ApiError):
    status = 503
    type = "service_unavailable"

    def __init__(self, message: str = "no healthy sampler is available") -> None:
        super().__init__(message, code="no_healthy_backend", headers={"Retry-After": "1"})


class BackendUnavailable(ApiError):
    """The sampler serving a request went away (mid-stream, or on every retry)."""

    status = 503
    type = "service_unavailable"

    def __init__(self) -> None:
        super().__init__(
            "the sampler serving this request became unavailable; retry the request",
            code="backend_unavailable",
            headers={"Retry-After": "1"},
        )


class BackendError(ApiError):
    status = 502
    type = "server_error"


class Timeout(ApiError):
    status = 504
    type = "timeout"


# The sampler's field names (sampler.proto) -> the OpenAI request's.
_PARAMS = {
    "sampling.n": "n",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.min_p": "min_p",
    "sampling.max_tokens": "max_tokens",
    "sampling.stop": "stop",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.seed": "seed",
    "sampling.top_logprobs": "top_logprobs",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    # The chat API asks for a structured output by response_format, or by a required or named
    # tool_choice (serving_chat renames it then).
    "sampling.structured_output": "response_format",
    "timeout": "timeout",
}


# A sampler field inside one chat message, or one part of its content.
_CHAT_PART = re.compile(r"prompt\.chat\.messages\[(\d+)\](?:\.parts\[(\d+)\])?")


def sampler_param(field: str | None, *, prompt_param: str) -> str | None:
    """The OpenAI request field behind a sampler BadRequest field: ``sampling.<x>`` maps by
    name, anything under ``prompt`` to ``prompt_param`` ("prompt" or "messages")."""
    if not field:
        return None
    for prefix, param in _PARAMS.items():
        if field == prefix or field.startswith(prefix + "["):
            return param
    part = _CHAT_PART.match(field)
    if part is not None and prompt_param == "messages":
        # The gateway sends a message's content parts one for one, so a part's index is the
        # client's own.
        message, index = part[1], part[2]
        return f"messages[{message}]" + (f".content[{index}]" if index is not None else "")
    if field.startswith("prompt"):
        return prompt_param
    return field


def context_length_exceeded(context: int, tokens: int, *, param: str) -> BadRequest:
    """OpenAI's error for a prompt (``param`` "prompt") or messages that leave no room to
    generate in the model's context."""
    what = "messages" if param == "messages" else "prompt"
    return BadRequest(
        f"This model's maximum context length is {context} tokens. However, your {what} "
        f"resulted in {tokens} tokens, which leaves no room for the completion. Please reduce "
        f"the length of the {what}.",
        param=param,
        code="context_length_exceeded",
    )


# The sampler's INVALID_ARGUMENT for a prompt with no room left (sampler/lm/requests.py).
_NO_ROOM = re.compile(r"the prompt has (\d+) tokens, leaving no room .* context of (\d+) tokens")


def from_backend(exc: BaseException, *, prompt_param: str, top_logprobs: str) -> ApiError:
    """The HTTP error for a failed sampler call that no other replica can fix.

    A 4xx carries the sampler's explanation without its address; a 5xx carries none of the
    sampler's message (addresses, transport details), which is logged here instead.
    """
    if isinstance(exc, ApiError):
        return exc
    code = exc.code if isinstance(exc, RlfleetError) else grpc.StatusCode.INTERNAL
    message = str(exc)
    field = exc.field if isinstance(exc, RlfleetError) else None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        param = sampler_param(field, prompt_param=prompt_param)
        if param == "top_logprobs":
            param = top_logprobs
        detail = _strip_peer(message)
        if param == prompt_param:
            no_room = _NO_ROOM.search(detail)
            if no_room is not None:
                return context_length_exceeded(int(no_room[2]), int(no_room[1]), param=prompt_param)
        at_prompt = param is not None and param.startswith(prompt_param)
        if at_prompt and field and detail.startswith(f"{field}: "):
            detail = detail[len(field) + 2 :]  # the sampler's field name, not the client's
        return BadRequest(detail, param=param)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(_strip_peer(message))
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return BadRequest(_strip_peer(message))
    log.warning("sampler call failed (%s): %s", code.name, message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED):
        return BackendUnavailable()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Timeout("the sampler did not finish the request in time", code="timeout")
    return BackendError("the sampler failed while serving the request", code="backend_error")


def _strip_peer(message: str) -> str:
    """'sampler 127.0.0.1:5: GenerateStream: n must be ...' -> 'n must be ...': the client
    should not see internal addresses in a 4xx."""
    parts = message.split(": ", 2)
    if len(parts) == 3 and parts[0].startswith("sampler "):
        return parts[2]
    return message
