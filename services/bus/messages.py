"""What travels on the bus: the headers every message carries, decoding, and deliveries.

A bus payload is one protobuf message. The ``Rlfleet-Type`` header names its full type so that a
receiver can refuse a message of the wrong type with a clear error instead of decoding garbage
(protobuf parses almost any bytes as almost any message), and so that one subscriber can read
every event kind of a run by looking the type up (``message_type=None``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import nats.errors
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from rlfleet.bus.v1 import trajectory_pb2
from services.errors import FailedPrecondition, InvalidArgument, Unavailable

__all__ = [
    "MSG_ID_HEADER",
    "TYPE_HEADER",
    "Delivery",
    "Subscription",
    "decode",
    "decode_payload_ref",
    "header_bytes",
]

TYPE_HEADER = "Rlfleet-Type"  # full protobuf name of the payload, e.g. rlfleet.bus.v1.Trajectory
MSG_ID_HEADER = "Nats-Msg-Id"  # JetStream drops a second message with the same id in the window

M = TypeVar("M", bound=Message)


# What a NATS request meets while a node dies or a leader is elected: no answer in time, no
# responder reachable yet (NATS's 503 status), the connection being re-made.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
)
# ...and those, or a connection closed for good.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    *TRANSIENT_ERRORS,
    nats.errors.ConnectionClosedError,
)


@dataclass(eq=False)
class Delivery(Generic[M]):
    """One received bus message, decoded, with its acknowledgement handles.

    For JetStream deliveries ``seq`` is the stream sequence and ``num_delivered`` counts
    deliveries (above 1 means a redelivery: the consumer must be idempotent). For core NATS
    deliveries ``seq`` is None and ack/nak/term/in_progress do nothing.
    """

    message: M
    subject: str
    headers: dict[str, str]
    seq: int | None = None
    num_delivered: int = 1
    _msg: Msg | None = field(default=None, repr=False)
    _ack_timeout_s: float = field(default=5.0, repr=False)
    _settled: str | None = field(default=None, repr=False)
    # Runs once the ack is confirmed (deletes a by-reference payload); failures are ignored.
    _after_ack: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)

    @property
    def settled(self) -> bool:
        """True once ack, nak or term went out."""
        return self._settled is not None

    async def ack(self) -> None:
        """Acknowledge and wait for the server to confirm, so an acked message is never redelivered.

        Raises Unavailable if the confirmation does not come in time; the message may then be
        redelivered after ack_wait, which an idempotent consumer tolerates.
        """
        msg = self._begin("ack")
        if msg is None:
            return
        try:
            await msg.ack_sync(timeout=self._ack_timeout_s)
        except UNAVAILABLE_ERRORS as exc:
            raise Unavailable(
                f"ack of seq {self.seq} on {self.subject!r} not confirmed within "
                f"{self._ack_timeout_s} s ({type(exc).__name__}); it will be redelivered"
            ) from exc
        self._settled = "ack"
        if self._after_ack is not None:
            with contextlib.suppress(Exception):
                await self._after_ack()

    async def nak(self, delay_s: float | None = None) -> None:
        """Give the message back for redelivery, after ``delay_s`` seconds if given."""
        msg = self._begin("nak")
        if msg is not None:
            await _unavailable_on_close(msg.nak(delay=delay_s), "nak")
            self._settled = "nak"

    async def term(self) -> None:
        """Drop the message for good: it will not be redelivered (poison messages)."""
        msg = self._begin("term")
        if msg is not None:
            await _unavailable_on_close(msg.term(), "term")
            self._settled = "term"

    async def in_progress(self) -> None:
        """Reset the ack_wait timer while a long piece of work is still going."""
        if self._msg is not None and self._settled is None:
            await _unavailable_on_close(self._msg.in_progress(), "in_progress")

    def _begin(self, action: str) -> Msg | None:
        if self._msg is not None and self._settled is not None:
            raise FailedPrecondition(
                f"cannot {action} seq {self.seq} on {self.subject!r}: already {self._settled}ed"
            )
        return self._msg


async def _unavailable_on_close(call: Awaitable[None], what: str) -> None:
    try:
        await call
    except UNAVAILABLE_ERRORS as exc:
        raise Unavailable(f"{what}: the NATS connection is closed or being re-made") from exc


def _class_for(full_name: str) -> type[Message]:
    """The generated class of ``full_name``; its ``_pb2`` module must have been imported."""
    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(full_name)
    except KeyError:
        raise InvalidArgument(
            f"unknown protobuf type {full_name!r} in the {TYPE_HEADER} header: import its _pb2 "
            "module or pass message_type",
            field="message_type",
        ) from None
    return message_factory.GetMessageClass(descriptor)


def decode_payload_ref(msg: Msg, where: str) -> trajectory_pb2.PayloadRef:
    """The PayloadRef a by-reference message carries (services/bus/payloads.py)."""
    ref = trajectory_pb2.PayloadRef()
    try:
        ref.ParseFromString(msg.data)
    except DecodeError as exc:
        raise InvalidArgument(f"{where}: not a valid PayloadRef: {exc}", field="payload") from exc
    if not ref.bucket or not ref.object or ref.size < 0:
        raise InvalidArgument(f"{where}: incomplete PayloadRef {ref}", field="payload")
    return ref


def decode(msg: Msg, message_type: type[M] | None, where: str, *, data: bytes | None = None) -> M:
    """Parse the payload (or ``data``, a by-reference payload's bytes) as ``message_type``; the
    type header must agree when present.

    With ``message_type=None`` the class is looked up from the header, which lets one subscriber
    (the launcher's monitor) read every event kind of a run.
    """
    payload = msg.data if data is None else data
    named = (msg.headers or {}).get(TYPE_HEADER)
    cls: type[Message]
    if message_type is None:
        if not named:
            raise InvalidArgument(
                f"{where}: no {TYPE_HEADER} header, so the payload type is unknown; "
                "pass message_type",
                field="message_type",
            )
        cls = _class_for(named)
    else:
        cls = message_type
        expected = cls.DESCRIPTOR.full_name
        if named and named != expected:
            raise InvalidArgument(
                f"{where}: expected a {expected} but the {TYPE_HEADER} header says {named}",
                field="message_type",
            )
    decoded = cls()
    try:
        decoded.ParseFromString(payload)
    except DecodeError as exc:
        raise InvalidArgument(
            f"{where}: {len(payload)} payload bytes are not a valid {cls.DESCRIPTOR.full_name}: "
            f"{exc}",
            field="message_type",
        ) from exc
    return decoded  # type: ignore[return-value]


def header_bytes(headers: Mapping[str, str]) -> int:
    """Size of the header block as nats-py encodes it (``NATS/1.0``, ``k: v`` lines, blank line)."""
    size = len(b"NATS/1.0\r\n\r\n")
    for key, value in headers.items():
        size += len(key.strip().encode()) + 2 + len(value.strip().encode()) + 2
    return size


class Subscription(Generic[M]):
    """A core NATS subscription as an async iterator of Delivery; active from creation.

    ``aclose()`` (also on leaving ``async with``) unsubscribes and ends the iteration, also
    from another task.
    """

    def __init__(self, sub: NatsSubscription, message_type: type[M] | None) -> None:
        self._sub = sub
        self._message_type = message_type
        self._messages = sub.messages

    def __aiter__(self) -> Subscription[M]:
        return self

    async def __anext__(self) -> Delivery[M]:
        msg = await self._messages.__anext__()
        message = decode(msg, self._message_type, f"message on {msg.subject!r}")
        return Delivery(message=message, subject=msg.subject, headers=dict(msg.headers or {}))

    async def aclose(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()

    async def __aenter__(self) -> Subscription[M]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
