"""The error hierarchy and its google.rpc.Status round trip."""

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from services import errors
from services.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlfleetError,
    Unavailable,
    from_status,
    to_status,
)

CODES = [
    (RlfleetError, grpc.StatusCode.INTERNAL),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
]


def details_of(status: status_pb2.Status) -> dict[str, object]:
    out = {}
    for kind in (
        error_details_pb2.BadRequest,
        error_details_pb2.ErrorInfo,
        error_details_pb2.RequestInfo,
    ):
        for detail in status.details:
            if detail.Is(kind.DESCRIPTOR):
                msg = kind()
                detail.Unpack(msg)
                out[kind.__name__] = msg
    return out


@pytest.mark.parametrize(("cls", "code"), CODES)
def test_each_class_maps_to_its_code_and_back(cls, code):
    status = to_status(cls("boom"))
    assert status.code == code.value[0]
    assert status.message == "boom"
    info = details_of(status)["ErrorInfo"]
    assert (info.reason, info.domain) == (cls.__name__, "rlfleet")
    back = from_status(status)
    assert type(back) is cls
    assert back.code == code
    assert back.message == "boom"


def test_field_becomes_bad_request_violation_and_returns():
    status = to_status(InvalidArgument("expected shape [4], got [3]", field="obs"))
    bad = details_of(status)["BadRequest"]
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("obs", "expected shape [4], got [3]")
    ]
    assert status.message == "expected shape [4], got [3]"
    back = from_status(status)
    assert (type(back), back.field, back.message) == (
        InvalidArgument,
        "obs",
        bad.field_violations[0].description,
    )
    assert str(back) == status.message


def test_no_field_means_no_bad_request_and_no_request_id_outside_a_call():
    found = details_of(to_status(NotFound("run x")))
    assert "BadRequest" not in found
    assert "RequestInfo" not in found


def test_request_id_from_argument_context_and_error():
    assert details_of(to_status(NotFound("x"), request_id="abc"))["RequestInfo"].request_id == "abc"
    token = errors.request_id_var.set("from-context")
    try:
        assert errors.current_request_id() == "from-context"
        status = to_status(NotFound("x"))
    finally:
        errors.request_id_var.reset(token)
    assert details_of(status)["RequestInfo"].request_id == "from-context"
    back = from_status(status)
    assert back.request_id == "from-context"
    # An error that came from another service keeps its original request id.
    assert details_of(to_status(back))["RequestInfo"].request_id == "from-context"


def test_unknown_exception_is_internal_naming_the_type():
    status = to_status(ValueError("negative length"))
    assert status.code == grpc.StatusCode.INTERNAL.value[0]
    assert status.message == "ValueError: negative length"
    assert details_of(status)["ErrorInfo"].reason == "ValueError"
    back = from_status(status)
    assert type(back) is RlfleetError
    assert back.code == grpc.StatusCode.INTERNAL
    assert errors.code_of(KeyError("k")) == grpc.StatusCode.INTERNAL
    assert to_status(KeyError()).message == "KeyError"


def test_bare_status_without_details_maps_by_code():
    back = from_status(status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message="gone"))
    assert (type(back), back.message) == (NotFound, "gone")
    # A code with no class of its own keeps the real code on a plain RlfleetError.
    late = from_status(
        status_pb2.Status(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="late")
    )
    assert type(late) is RlfleetError
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert RlfleetError.code == grpc.StatusCode.INTERNAL  # the class default is untouched


def test_foreign_error_info_and_inconsistent_reason_fall_back_to_code():
    status = to_status(NotFound("x"))
    status.details[0].Pack(error_details_pb2.ErrorInfo(reason="NotFound", domain="googleapis.com"))
    assert type(from_status(status)) is NotFound
    # ErrorInfo names a class whose code disagrees with the status code: the code wins.
    lying = to_status(ConfigError("x"))
    lying.code = grpc.StatusCode.UNAVAILABLE.value[0]
    assert type(from_status(lying)) is Unavailable


def test_subclasses_elsewhere_round_trip():
    class SessionLimit(ResourceExhausted):
        pass

    back = from_status(to_status(SessionLimit("8 sessions max", field="max_sessions")))
    assert type(back) is SessionLimit
    assert back.field == "max_sessions"


def test_repr_and_str():
    assert repr(InvalidArgument("bad", field="f")) == "InvalidArgument('bad', field='f')"
    assert str(ConfigError("run.yaml:3: run.name: invalid")) == "run.yaml:3: run.name: invalid"


class _TransportError(grpc.RpcError):
    """A failed call as grpc reports one it made itself: a code, a message, no details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_bare_internal_from_the_transport_is_unavailable():
    # A peer whose connection breaks mid-stream ("Internal error from Core") is retried like
    # any other unreachable peer; an INTERNAL sent by an rlfleet server carries details.
    err = errors.from_rpc_error(
        _TransportError(grpc.StatusCode.INTERNAL, "Internal error from Core")
    )
    assert isinstance(err, errors.Unavailable) and "Internal error from Core" in str(err)
    err = errors.from_rpc_error(_TransportError(grpc.StatusCode.NOT_FOUND, "gone"))
    assert isinstance(err, errors.NotFound)
