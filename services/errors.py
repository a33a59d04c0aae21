"""The one error hierarchy of rlfleet, and its mapping to gRPC statuses.

Every service raises these instead of calling ``context.abort`` by hand, so that the same error
reads the same way everywhere: as a gRPC status code on unary calls, as an in-band
``google.rpc.Status`` inside streams (which must survive a bad request), and as the same Python
class again on the client side (``from_status`` / ``from_rpc_error``).

The details always carry a ``google.rpc.ErrorInfo`` (reason = class name, domain ``rlfleet``) so
the client can rebuild the exact subclass, a ``google.rpc.BadRequest`` field violation when the
error names a field, and a ``google.rpc.RequestInfo`` when a request id is known, so an error seen
by a user can be found in the server's logs.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple, NoReturn

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = [
    "DOMAIN",
    "EXIT_PERMANENT",
    "REQUEST_ID_KEY",
    "ConfigError",
    "ConfigIssue",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "RlfleetError",
    "Unavailable",
    "abort_with",
    "code_of",
    "current_request_id",
    "from_rpc_error",
    "from_status",
    "is_permanent",
    "request_id_var",
    "to_status",
]

DOMAIN = "rlfleet"
REQUEST_ID_KEY = "x-request-id"
# Exit status of `rlfleet serve` for a failure a restart cannot heal (a bad setting, a payload
# that can never fit the bus: ConfigError or InvalidArgument): one line on stderr, no traceback,
# and the launcher fails the run at once instead of restarting the service.
EXIT_PERMANENT = 3

# The request id of the RPC being handled, set by the server's request-id interceptor. It lives
# here rather than in server.py because to_status() reads it to fill RequestInfo, and server.py
# imports this module.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rlfleet_request_id", default=None
)

_CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def current_request_id() -> str | None:
    """The ``x-request-id`` of the RPC this task is handling, or None outside a handler."""
    return request_id_var.get()


class RlfleetError(Exception):
    """Root of every error rlfleet raises on purpose; ``code`` is the gRPC status it maps to."""

    # A class default that from_status() may override on one instance (a code with no class).
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    _by_name: ClassVar[dict[str, type[RlfleetError]]] = {}

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        # Filled by from_status() so a client can quote the server-side request id.
        self.request_id: str | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        # Subclasses defined in other packages are found again by from_status() once imported.
        super().__init_subclass__(**kwargs)
        RlfleetError._by_name.setdefault(cls.__name__, cls)

    def __repr__(self) -> str:
        field = f", field={self.field!r}" if self.field else ""
        return f"{type(self).__name__}({self.message!r}{field})"


RlfleetError._by_name["RlfleetError"] = RlfleetError


class InvalidArgument(RlfleetError):
    """Bad input: wrong shape, dtype or value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RlfleetError):
    """An id the service does not know."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RlfleetError):
    """A call made out of order (e.g. step before reset)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RlfleetError):
    """A limit was reached (sessions, queue, memory); the caller may retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RlfleetError):
    """A transient fault; the channel's service config retries these."""

    code = grpc.StatusCode.UNAVAILABLE


class ConfigIssue(NamedTuple):
    """One problem of a config: the key's dotted path (``job.learning_rate``,
    ``services[1].settings.port``), its line in the file (None: not from a file) and why."""

    path: str
    line: int | None
    message: str


class ConfigError(RlfleetError):
    """An invalid configuration; the message names the key (and file:line when known).
    ``issues`` has the same problems one by one, for a form that shows each beside its field
    (empty when the error is not about particular keys)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(
        self, message: str, *, field: str | None = None, issues: Sequence[ConfigIssue] = ()
    ) -> None:
        super().__init__(message, field=field)
        self.issues = tuple(issues)


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure that a restart with the same config cannot heal."""
    return isinstance(exc, ConfigError | InvalidArgument)


# Which class a bare status code becomes when the details do not name one (e.g. an error made by
# grpc itself or by a non-rlfleet server).
_CLASS_BY_CODE: dict[grpc.StatusCode, type[RlfleetError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable)
}


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status code an exception maps to: its own for RlfleetError, INTERNAL otherwise."""
    return exc.code if isinstance(exc, RlfleetError) else grpc.StatusCode.INTERNAL


def _message_of(exc: BaseException) -> str:
    if isinstance(exc, RlfleetError):
        return str(exc)
    # An unexpected exception: name its type, since the message alone ("0") is often useless.
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def to_status(exc: BaseException, *, request_id: str | None = None) -> status_pb2.Status:
    """The ``google.rpc.Status`` for an exception: code, message and rlfleet details.

    Used for in-band errors in streams and, by the server's interceptor, for call errors.
    ``request_id`` defaults to the error's own (if it came from another service) or to the
    request id of the RPC being handled.
    """
    code = code_of(exc)
    status = status_pb2.Status(code=code.value[0], message=_message_of(exc))
    if isinstance(exc, RlfleetError) and exc.field:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=exc.message
        )
        status.details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    status.details.append(
        _pack(error_details_pb2.ErrorInfo(reason=type(exc).__name__, domain=DOMAIN))
    )
    if request_id is None and isinstance(exc, RlfleetError):
        request_id = exc.request_id
    if request_id is None:
        request_id = current_request_id()
    if request_id:
        status.details.append(_pack(error_details_pb2.RequestInfo(request_id=request_id)))
    return status


def from_status(status: status_pb2.Status) -> RlfleetError:
    """Rebuild the error a ``google.rpc.Status`` describes, as the right RlfleetError subclass.

    The class comes from ErrorInfo when it names a known rlfleet class, else from the code;
    a code with no class of its own becomes a plain RlfleetError carrying that code.
    """
    code = _CODE_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    cls: type[RlfleetError] | None = None
    field: str | None = None
    message = status.message
    request_id: str | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                cls = RlfleetError._by_name.get(info.reason)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                field = bad.field_violations[0].field
                message = bad.field_violations[0].description
        elif detail.Is(error_details_pb2.RequestInfo.DESCRIPTOR):
            req = error_details_pb2.RequestInfo()
            detail.Unpack(req)
            request_id = req.request_id or None
    if cls is None or cls.code != code:
        cls = _CLASS_BY_CODE.get(code, RlfleetError)
    err = cls(message, field=field)
    if err.code != code:
        err.code = code  # e.g. DEADLINE_EXCEEDED from grpc itself: keep the real code
    err.request_id = request_id
    return err


def from_rpc_error(error: grpc.RpcError) -> RlfleetError:
    """The RlfleetError behind a failed call (``grpc.aio.AioRpcError`` or a sync ``grpc.Call``).

    Uses the ``grpc-status-details-bin`` trailer when the server sent one, else the bare code and
    details (errors grpc makes itself, such as DEADLINE_EXCEEDED, carry none).
    """
    try:
        status = rpc_status.from_call(error)
    except ValueError:
        status = None  # details inconsistent with the code: trust the code
    if status is None:
        code: grpc.StatusCode = error.code()
        if code == grpc.StatusCode.INTERNAL:
            # rlfleet servers attach details to every error they send, so a bare INTERNAL is the
            # transport's own ("Internal error from Core", RST_STREAM when a peer's connection
            # breaks): the peer went away, which callers retry like any UNAVAILABLE.
            code = grpc.StatusCode.UNAVAILABLE
        status = status_pb2.Status(code=code.value[0], message=error.details() or "")
    return from_status(status)


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    """End the current RPC with the status for ``exc`` (details in ``grpc-status-details-bin``).

    The request id also goes into the trailing metadata, so a client that only looks at the
    call's metadata still finds it. Raises grpc.aio.AbortError, as ``context.abort`` does.
    """
    request_id = current_request_id()
    status = rpc_status.to_status(to_status(exc, request_id=request_id))
    if request_id:
        status = status._replace(
            trailing_metadata=(*status.trailing_metadata, (REQUEST_ID_KEY, request_id))
        )
    await context.abort_with_status(status)
    raise AssertionError("unreachable: abort_with_status always raises")  # pragma: no cover
