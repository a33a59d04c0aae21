"""The bus client every service uses: protobuf messages over NATS core and JetStream.

Why a wrapper around nats-py rather than nats-py directly:
- one place sets the headers every bus message carries (``Nats-Msg-Id`` for JetStream dedupe,
  ``Rlfleet-Type`` naming the protobuf type, the trace context) and checks them on the way in;
- nats-py checks only the payload against the server's max payload, while the server counts
  headers too and answers an oversize message by closing the connection; we check the total
  first and raise InvalidArgument instead;
- a durable pull consumer becomes a plain ``async for`` that survives reconnects and fetch
  timeouts, with explicit, confirmed acks (at-least-once; consumers must be idempotent);
- nats-py and JetStream errors become the project's error classes (services/errors.py).

``Bus`` is one class because it is the one object every service holds: connect, streams,
publish, pull consumers, subscriptions and KV share its connection state and error mapping; the
message types, subjects and the server process live beside it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Mapping
from types import ModuleType, TracebackType
from typing import Any, Literal, TypeVar

import nats.errors
import nats.js.errors
from google.protobuf.message import Message
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.kv import KeyValue

from services import security
from services.bus.messages import (
    MSG_ID_HEADER,
    TRANSIENT_ERRORS,
    TYPE_HEADER,
    UNAVAILABLE_ERRORS,
    Delivery,
    Subscription,
    decode,
    decode_payload_ref,
    header_bytes,
)
from services.bus.payloads import PAYLOAD_HEADER, PayloadStore
from services.bus.subjects import inbox_prefix
from services.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlfleetError,
    Unavailable,
)

__all__ = ["REPLICAS_ENV", "Bus", "PubAck", "server_list"]

log = logging.getLogger("rlfleet.bus")

# A publish retried while it fails with Unavailable outlasts a clustered stream's leader
# election (several seconds after its leader node dies) with room to spare.
PUBLISH_ATTEMPTS = 8
MAX_RETRY_DELAY_S = 4.0

PubAck = api.PubAck  # .stream, .seq, .duplicate (a bool once Bus.publish returns it)
# How many copies of each stream and bucket this Bus creates (unset: 1); the launcher sets it
# from its run file's `nats.cluster`, a deployment beside its NATS cluster.
REPLICAS_ENV = "RLFLEET_NATS_REPLICAS"
_JETSTREAM_POLL_S = 0.5  # how often wait_for_jetstream asks again

M = TypeVar("M", bound=Message)
Retention = Literal["limits", "workqueue"]


@functools.cache
def _telemetry() -> ModuleType | None:
    """services.telemetry if importable; looked up once, so a broken install warns once."""
    try:
        return importlib.import_module("services.telemetry")
    except ModuleNotFoundError as exc:
        if exc.name not in ("services.telemetry", "services"):
            log.warning("trace context will not be propagated on the bus: %s", exc)
    except ImportError as exc:  # telemetry present but broken: publish anyway, say why
        log.warning("trace context will not be propagated on the bus: %s", exc)
    return None


def _inject_trace(headers: dict[str, str]) -> dict[str, str]:
    """Add the trace context with ``services.telemetry.inject`` when that module provides it."""
    inject = getattr(_telemetry(), "inject", None)
    if inject is None:
        return headers
    result = inject(headers)
    return headers if result is None else result


def _bus_span(
    operation: str, subject: str, headers: Mapping[str, str] | None = None
) -> contextlib.AbstractContextManager[None]:
    """``services.telemetry.bus_span`` when that module provides it, else nothing."""
    bus_span = getattr(_telemetry(), "bus_span", None)
    if bus_span is None:
        return contextlib.nullcontext()
    return bus_span(operation, subject, headers)  # type: ignore[no-any-return]


def _api_error(exc: nats.js.errors.APIError, what: str) -> RlfleetError:
    """Map a JetStream API error to the project's error classes, keeping NATS's own words."""
    text = f"{what}: {exc.description or type(exc).__name__} (NATS err_code {exc.err_code})"
    description = (exc.description or "").lower()
    if isinstance(exc, nats.js.errors.ServiceUnavailableError) or exc.code == 503:
        return Unavailable(text)
    if isinstance(exc, nats.js.errors.NotFoundError) or exc.code == 404:
        return NotFound(text)
    if "maximum" in description or "insufficient resources" in description:
        return ResourceExhausted(text)
    if "overlap" in description or "not unique" in description or exc.code == 409:
        return FailedPrecondition(text)
    if exc.code == 400:
        return InvalidArgument(text)
    return RlfleetError(text)


T = TypeVar("T")


async def retry_unavailable(
    what: str,
    call: Callable[[], Awaitable[T]],
    attempts: int = PUBLISH_ATTEMPTS,
    first_delay_s: float = 0.5,
) -> T:
    """``call()``, tried up to ``attempts`` times while it raises Unavailable, waiting
    ``first_delay_s`` and then twice as long (at most ``MAX_RETRY_DELAY_S``) before each next
    try; the last Unavailable propagates, any other error at once."""
    if attempts < 1:
        raise InvalidArgument(f"{what}: attempts must be >= 1, got {attempts}", field="attempts")
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except Unavailable as exc:
            if attempt == attempts:
                raise
            log.warning("%s: %s; retrying", what, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY_S)
    raise AssertionError("unreachable")  # the loop returns or raises


def server_list(url: str | Iterable[str]) -> list[str]:
    """The server URLs in ``url``: one URL, several joined by commas (``RLFLEET_NATS_URL`` of
    a cluster), or a list; nats-py takes a list and fails over between its entries."""
    urls = url.split(",") if isinstance(url, str) else list(url)
    servers = [u.strip() for u in urls]
    if not servers or not all(servers):
        raise InvalidArgument(f"Bus.connect: no NATS url given ({url!r})", field="nats.url")
    return servers


def _replicas_from_env() -> int:
    text = os.environ.get(REPLICAS_ENV, "").strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"${REPLICAS_ENV} must be a positive whole number, got {text!r}")
    return int(text)


# ---------------------------------------------------------------------------- the bus


class _Connecting:
    """What Bus.connect returns: await it for a Bus, or ``async with`` it to close on exit."""

    def __init__(self, factory: Callable[[], Awaitable[Bus]]) -> None:
        self._factory = factory
        self._bus: Bus | None = None

    def __await__(self) -> Generator[Any, None, Bus]:
        return self._factory().__await__()

    async def __aenter__(self) -> Bus:
        self._bus = await self._factory()
        return self._bus

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bus is not None:
            await self._bus.close()


class Bus:
    """A connection to NATS with JetStream; create it with ``Bus.connect(url, name=...)``."""

    def __init__(
        self, nc: NatsClient, *, name: str, request_timeout_s: float = 5.0, replicas: int = 1
    ) -> None:
        if replicas < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {replicas}", field="replicas")
        self._nc = nc
        self._js = nc.jetstream(timeout=request_timeout_s)
        self.name = name
        self.request_timeout_s = request_timeout_s
        # Copies of every stream and bucket this Bus creates: one place, so none is forgotten.
        self.replicas = replicas
        self._kv: dict[str, KeyValue] = {}
        self._payloads = PayloadStore(self._js, replicas=replicas)
        self._closing = False

    # ------------------------------------------------------------------ connection

    @classmethod
    def connect(
        cls,
        url: str | list[str],
        *,
        name: str,
        connect_timeout_s: float = 2.0,
        connect_attempts: int = 3,
        reconnect_wait_s: float = 0.5,
        max_reconnect_attempts: int = -1,
        request_timeout_s: float = 5.0,
        replicas: int | None = None,
    ) -> _Connecting:
        """Connect as client ``name``: ``bus = await Bus.connect(...)`` or ``async with``.

        ``url`` is one server, several joined by commas, or a list: the servers of one cluster,
        any of which will do. The first connection tries ``connect_attempts`` times per server
        and then raises Unavailable, so a wrong URL fails fast. Once connected the client
        reconnects on its own to whichever server answers (forever by default: a service
        outlives a NATS restart or a node's loss), buffering publishes meanwhile. ``replicas``:
        copies of each stream and bucket this Bus creates (None: ``$RLFLEET_NATS_REPLICAS``, 1
        when unset).
        """
        if replicas is None:
            replicas = _replicas_from_env()
        return _Connecting(
            lambda: cls._connect(
                url,
                name=name,
                connect_timeout_s=connect_timeout_s,
                connect_attempts=connect_attempts,
                reconnect_wait_s=reconnect_wait_s,
                max_reconnect_attempts=max_reconnect_attempts,
                request_timeout_s=request_timeout_s,
                replicas=replicas,
            )
        )

    @classmethod
    async def _connect(
        cls,
        url: str | list[str],
        *,
        name: str,
        connect_timeout_s: float,
        connect_attempts: int,
        reconnect_wait_s: float,
        max_reconnect_attempts: int,
        request_timeout_s: float,
        replicas: int,
    ) -> Bus:
        servers = server_list(url)
        nc = NatsClient()
        connected = False

        async def on_error(exc: Exception) -> None:
            level = logging.WARNING if connected else logging.DEBUG
            log.log(level, "nats client %r: %s: %s", name, type(exc).__name__, exc)

        async def on_disconnected() -> None:
            if connected and not nc.is_closed:
                log.warning("nats client %r: disconnected, reconnecting", name)

        async def on_reconnected() -> None:
            url = nc.connected_url
            log.info("nats client %r: reconnected to %s", name, url.netloc if url else "?")

        # Credentials and TLS from the environment (services/security.py), as the launcher,
        # compose and Kubernetes hand them to each service.
        secure: dict[str, Any] = {}
        if (creds := security.nats_credentials()) is not None:
            # Replies come to an inbox of this user's own, the only one its permissions let
            # it subscribe to (subjects.service_permissions).
            secure.update(
                user=creds.user, password=creds.password, inbox_prefix=inbox_prefix(creds.user)
            )
        if (tls := security.tls_files()) is not None:
            secure["tls"] = security.ssl_context(tls)
        try:
            # nats-py annotates both timeouts as int but uses them as seconds in asyncio
            # (wait_for, sleep), which take floats: the annotations are too narrow.
            # The overall bound also covers a TLS handshake that never completes (a client
            # without certificates against a server that requires them), which nats-py's
            # connect_timeout does not.
            await asyncio.wait_for(
                nc.connect(
                    **secure,
                    servers=servers,
                    name=name,
                    connect_timeout=connect_timeout_s,  # type: ignore[arg-type]
                    reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
                    # nats-py reads this as "retries per server", also for the first connect.
                    max_reconnect_attempts=max(1, connect_attempts - 1),
                    ping_interval=20,
                    max_outstanding_pings=3,
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                ),
                timeout=connect_timeout_s * connect_attempts * len(servers) + 5.0,
            )
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            cause = nc.last_error or exc
            with contextlib.suppress(Exception):
                await nc.close()  # stop a half-open attempt from retrying in the background
            raise Unavailable(
                f"cannot connect to NATS at {', '.join(servers)} as {name!r}: "
                f"{type(cause).__name__}: {cause}"
            ) from exc
        connected = True
        # From now on reconnect as configured (the first connect used a short budget).
        nc.options["max_reconnect_attempts"] = max_reconnect_attempts
        return cls(nc, name=name, request_timeout_s=request_timeout_s, replicas=replicas)

    @property
    def nc(self) -> NatsClient:
        """The underlying nats-py client, for what this wrapper does not cover."""
        return self._nc

    @property
    def js(self) -> Any:
        """The nats-py JetStream context."""
        return self._js

    @property
    def payloads(self) -> PayloadStore:
        """The object store buckets of messages sent by reference (payloads.py)."""
        return self._payloads

    @property
    def max_payload(self) -> int:
        """The server's limit on one message, headers included, in bytes."""
        return int(self._nc.max_payload)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Flush what was published, then close; safe to call twice.

        Not nats-py's ``drain()``: that waits for every subscription's unread queue, and a pull
        consumer's queue never empties, so it would hang for its full 30 s timeout. Nothing is
        lost without it: publishes are flushed, unacked JetStream messages come back after
        ack_wait, and open iterators end (pull iterators cleanly, subscriptions too).
        """
        if self._closing:
            return
        self._closing = True
        if self._nc.is_connected:
            try:
                # Seconds for asyncio.wait_for: a float, whatever nats-py's int annotation says.
                await self._nc.flush(timeout=timeout_s)  # type: ignore[arg-type]
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                log.warning("nats client %r: flush before close failed: %s", self.name, exc)
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ JetStream admin

    async def wait_for_jetstream(self, timeout_s: float) -> None:
        """Return once JetStream answers (in a cluster: once its nodes have elected a meta
        leader, which takes a majority of them up and routed to each other); Unavailable after
        ``timeout_s``, naming the servers and JetStream's last answer. Needs the right to ask
        for account info (``$JS.API.INFO``), which the launcher's user has."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._js.account_info(), max(0.1, remaining))
                return
            except nats.js.errors.APIError as exc:
                last = f"{exc.description or type(exc).__name__} (NATS err_code {exc.err_code})"
            except (TimeoutError, nats.errors.Error) as exc:
                last = f"no answer ({type(exc).__name__})"
            if time.monotonic() + _JETSTREAM_POLL_S >= deadline:
                servers = ", ".join(u.netloc for u in self._nc.servers) or "?"
                raise Unavailable(
                    f"JetStream at {servers} not ready after {timeout_s:g} s (no meta leader "
                    f"elected: a cluster needs a majority of its nodes up and routed to each "
                    f"other); last answer: {last}"
                )
            await asyncio.sleep(_JETSTREAM_POLL_S)

    async def ensure_stream(
        self,
        name: str,
        subjects: Iterable[str],
        *,
        max_age_s: float | None = None,
        max_bytes: int | None = None,
        retention: Retention = "limits",
        duplicate_window_s: float = 120.0,
        discard: Literal["old", "new"] = "old",
    ) -> api.StreamInfo:
        """Create the stream, or update it to this configuration; idempotent.

        ``retention="workqueue"`` deletes each message once acked (prompt queues); ``limits``
        keeps messages until ``max_age_s``/``max_bytes`` (None = unlimited). ``discard="new"``
        makes a full stream refuse publishes instead of dropping its oldest messages. The
        dedupe window is capped at ``max_age_s``, as the server requires. Retention cannot
        change on an existing stream: that raises FailedPrecondition. A new stream is kept in
        ``self.replicas`` copies; an existing one keeps the count it was made with.
        """
        subjects = list(subjects)
        if retention not in ("limits", "workqueue"):
            raise InvalidArgument(
                f"ensure_stream {name!r}: retention must be 'limits' or 'workqueue', "
                f"got {retention!r}",
                field="retention",
            )
        if not subjects:
            raise InvalidArgument(f"ensure_stream {name!r}: no subjects", field="subjects")
        max_age = float(max_age_s or 0.0)
        window = min(duplicate_window_s, max_age) if max_age else duplicate_window_s
        settings: dict[str, Any] = {
            "subjects": subjects,
            "retention": api.RetentionPolicy(retention),
            "max_age": max_age,
            "max_bytes": -1 if max_bytes is None else int(max_bytes),
            "duplicate_window": float(window),
            "discard": api.DiscardPolicy(discard),
        }
        what = f"ensure_stream {name!r}"
        try:
            try:
                info = await self._js.stream_info(name)
            except nats.js.errors.NotFoundError:
                config = api.StreamConfig(
                    name=name,
                    storage=api.StorageType.FILE,
                    num_replicas=self.replicas,
                    **settings,
                )
                return await self._js.add_stream(config)
            have = info.config
            if have.retention != settings["retention"]:
                raise FailedPrecondition(
                    f"{what}: the stream exists with retention {str(have.retention)!r}, which "
                    f"cannot change to {retention!r}; delete the stream first",
                    field="retention",
                )
            current = {key: getattr(have, key) for key in settings}
            current["subjects"] = list(have.subjects or [])
            if current == settings:
                return info
            return await self._js.update_stream(have.evolve(**settings))
        except nats.js.errors.APIError as exc:
            raise _api_error(exc, what) from exc
        except TRANSIENT_ERRORS as exc:
            raise Unavailable(f"{what}: no answer from JetStream ({type(exc).__name__})") from exc

    async def kv(self, bucket: str, *, history: int = 1, ttl_s: float | None = None) -> KeyValue:
        """The JetStream key-value bucket ``bucket``, created if missing (run state lives here),
        in ``self.replicas`` copies."""
        if bucket in self._kv:
            return self._kv[bucket]
        try:
            try:
                store = await self._js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                store = await self._js.create_key_value(
                    bucket=bucket, history=history, ttl=ttl_s, replicas=self.replicas
                )
        except nats.js.errors.InvalidBucketNameError as exc:
            raise InvalidArgument(
                f"invalid KV bucket name {bucket!r}: use letters, digits, '-' and '_'",
                field="bucket",
            ) from exc
        except nats.js.errors.APIError as exc:
            raise _api_error(exc, f"kv bucket {bucket!r}") from exc
        except TRANSIENT_ERRORS as exc:
            raise Unavailable(
                f"kv bucket {bucket!r}: no answer from JetStream ({type(exc).__name__})"
            ) from exc
        self._kv[bucket] = store
        return store

    # ------------------------------------------------------------------ publishing

    def _headers(self, message: Message, headers: Mapping[str, str] | None) -> dict[str, str]:
        out = {str(k): str(v) for k, v in (headers or {}).items()}
        out = _inject_trace(out)
        out[TYPE_HEADER] = message.DESCRIPTOR.full_name
        return out

    def _check_size(
        self, subject: str, message: Message, data: bytes, headers: Mapping[str, str]
    ) -> None:
        """Refuse what the server would refuse: it answers an oversize message by disconnecting."""
        header_size = header_bytes(headers)
        total = len(data) + header_size
        limit = self.max_payload
        if total > limit:
            raise InvalidArgument(
                f"{message.DESCRIPTOR.full_name} for {subject!r} is {total} bytes "
                f"({len(data)} payload + {header_size} headers), over the server's max payload "
                f"of {limit} bytes; send large data by reference",
                field="message",
            )

    async def publish(
        self,
        subject: str,
        message: Message,
        *,
        msg_id: str,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        by_reference: bool = True,
    ) -> api.PubAck:
        """Store ``message`` in the JetStream stream capturing ``subject``; returns the PubAck.

        ``msg_id`` must be stable across retries of the same logical message: the server drops
        a repeat within the stream's duplicate window and answers ``ack.duplicate == True``.
        A message over the server's max payload goes by reference (services/bus/payloads.py)
        unless ``by_reference`` is False; then it is InvalidArgument.
        """
        if not msg_id:
            raise InvalidArgument(f"publish to {subject!r}: msg_id is required", field="msg_id")
        with _bus_span("publish", subject):  # the headers made inside name this span
            return await self._publish(subject, message, msg_id, headers, timeout_s, by_reference)

    async def _publish(
        self,
        subject: str,
        message: Message,
        msg_id: str,
        headers: Mapping[str, str] | None,
        timeout_s: float | None,
        by_reference: bool,
    ) -> api.PubAck:
        data = message.SerializeToString()
        hdrs = self._headers(message, headers)
        hdrs[MSG_ID_HEADER] = str(msg_id)
        if by_reference and len(data) + header_bytes(hdrs) > self.max_payload:
            ref = await self._payloads.put(subject, str(msg_id), data, hdrs[TYPE_HEADER])
            data = ref.SerializeToString()
            hdrs[PAYLOAD_HEADER] = "ref"
        self._check_size(subject, message, data, hdrs)
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        what = f"publish to {subject!r}"
        try:
            ack = await self._js.publish(subject, data, timeout=timeout, headers=hdrs)
        except nats.js.errors.NoStreamResponseError as exc:
            if self.replicas > 1:  # in a cluster, also what a stream electing its leader answers
                raise Unavailable(
                    f"{what}: no stream answered (its leader is being elected, or no stream "
                    "stores this subject); retry with the same msg_id"
                ) from exc
            raise NotFound(
                f"{what}: no JetStream stream stores this subject; call ensure_stream first",
                field="subject",
            ) from exc
        except nats.js.errors.APIError as exc:
            raise _api_error(exc, what) from exc
        except nats.errors.MaxPayloadError as exc:  # the check above should have caught it
            raise InvalidArgument(f"{what}: over the server's max payload", field="message") from (
                exc
            )
        except UNAVAILABLE_ERRORS as exc:
            raise Unavailable(
                f"{what}: not acknowledged within {timeout} s ({type(exc).__name__}); retry with "
                "the same msg_id"
            ) from exc
        ack.duplicate = bool(ack.duplicate)  # the server omits it when false
        return ack

    async def publish_with_retry(
        self,
        subject: str,
        message: Message,
        *,
        msg_id: str,
        attempts: int = PUBLISH_ATTEMPTS,
        first_delay_s: float = 0.5,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        by_reference: bool = True,
    ) -> api.PubAck:
        """``publish``, tried up to ``attempts`` times while it fails with Unavailable (not
        acknowledged in time, connection being re-made, a clustered stream electing a leader),
        waiting ``first_delay_s`` and then twice as long (at most ``MAX_RETRY_DELAY_S``) before
        each next try. Every try sends the same ``msg_id``, so a message
        that did arrive the first time is stored once. The last Unavailable propagates; other
        errors (InvalidArgument: over the max payload without by_reference; NotFound: no stream,
        on a bus of one copy, where with replicas it is Unavailable as while a stream elects its
        leader) at once."""
        return await retry_unavailable(
            f"publishing {msg_id}",
            lambda: self.publish(
                subject,
                message,
                msg_id=msg_id,
                headers=headers,
                timeout_s=timeout_s,
                by_reference=by_reference,
            ),
            attempts,
            first_delay_s,
        )

    async def publish_event(
        self, subject: str, message: Message, headers: Mapping[str, str] | None = None
    ) -> None:
        """Core NATS publish (no storage, no ack): events that only live subscribers need."""
        data = message.SerializeToString()
        hdrs = self._headers(message, headers)
        self._check_size(subject, message, data, hdrs)
        try:
            await self._nc.publish(subject, data, headers=hdrs)
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as exc:
            raise Unavailable(f"publish_event to {subject!r}: {type(exc).__name__}") from exc

    # ------------------------------------------------------------------ consuming

    async def subscribe(
        self, subject: str, message_type: type[M] | None, *, queue: str = ""
    ) -> Subscription[M]:
        """Core NATS subscription; live from when this returns (no history, no acks).

        ``message_type=None`` decodes each message by its ``Rlfleet-Type`` header; a message of
        another type than ``message_type`` raises InvalidArgument from the iteration.
        """
        try:
            sub = await self._nc.subscribe(subject, queue=queue)
        except nats.errors.Error as exc:
            raise Unavailable(f"subscribe to {subject!r}: {type(exc).__name__}: {exc}") from exc
        return Subscription(sub, message_type)

    def pull(
        self,
        stream: str,
        durable: str,
        subject: str,
        message_type: type[M] | None,
        *,
        batch: int = 64,
        timeout_s: float = 1.0,
        ack_wait_s: float = 30.0,
        max_deliver: int = -1,
        max_ack_pending: int | None = None,
        stop_event: asyncio.Event | None = None,
    ) -> AsyncIterator[Delivery[M]]:
        """Deliveries from the durable pull consumer ``durable`` on ``stream`` (filter ``subject``).

        The consumer is created or updated on first iteration (explicit acks; an unacked
        message comes back after ``ack_wait_s``, at most ``max_deliver`` times, -1 = no limit).
        Several iterators on the same durable share its messages (work queues). Iteration
        fetches up to ``batch`` at a time, treats an empty fetch (``timeout_s``) as "nothing
        yet", and ends when ``stop_event`` is set (checked between fetches, so within about
        ``timeout_s``) or the iterator is closed (``aclose``). Fetched messages not yet handed
        out are nak'ed on exit so they come back at once. A message whose ``Rlfleet-Type``
        names another type, or that does not decode, is terminated and raises InvalidArgument.
        """
        if batch < 1 or timeout_s <= 0:
            raise InvalidArgument(
                f"pull {durable!r}: batch must be >= 1 and timeout_s > 0, got {batch}, {timeout_s}",
                field="batch",
            )
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
        )
        return self._pull(stream, config, message_type, batch, timeout_s, stop_event)

    async def _pull(
        self,
        stream: str,
        config: api.ConsumerConfig,
        message_type: type[M] | None,
        batch: int,
        timeout_s: float,
        stop_event: asyncio.Event | None,
    ) -> AsyncIterator[Delivery[M]]:
        durable = str(config.durable_name)
        what = f"pull {stream}/{durable}"
        # Retried while JetStream is electing a leader or a node is being replaced.
        sub = await retry_unavailable(what, lambda: self._bind_consumer(stream, config, what))
        backlog: collections.deque[Msg] = collections.deque()
        try:
            while not self._closing and (stop_event is None or not stop_event.is_set()):
                if not backlog:
                    fetched = await self._fetch(sub, batch, timeout_s, what)
                    if fetched is None:
                        return
                    backlog.extend(fetched)
                    continue
                msg = backlog.popleft()
                meta = msg.metadata
                where = f"{what}: seq {meta.sequence.stream} on {msg.subject!r}"
                after_ack = None
                # The receive span covers decoding (and fetching a payload stored by reference).
                with _bus_span("receive", msg.subject, msg.headers or {}):
                    try:
                        if (msg.headers or {}).get(PAYLOAD_HEADER) == "ref":
                            ref = decode_payload_ref(msg, where)
                            data = await self._payloads.get(ref, where)
                            message = decode(msg, message_type, where, data=data)
                            after_ack = functools.partial(self._payloads.delete, ref)
                        else:
                            message = decode(msg, message_type, where)
                    except InvalidArgument as exc:
                        with contextlib.suppress(nats.errors.Error):
                            await msg.term()
                        raise InvalidArgument(
                            f"{exc.message} (terminated: not redelivered)", field=exc.field
                        ) from exc
                yield Delivery(
                    message=message,
                    subject=msg.subject,
                    headers=dict(msg.headers or {}),
                    seq=meta.sequence.stream,
                    num_delivered=meta.num_delivered,
                    _msg=msg,
                    _ack_timeout_s=self.request_timeout_s,
                    _after_ack=after_ack,
                )
        finally:
            for msg in backlog:
                with contextlib.suppress(nats.errors.Error, OSError):
                    await msg.nak()
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()

    async def _bind_consumer(self, stream: str, config: api.ConsumerConfig, what: str) -> Any:
        """Create or update the durable consumer (the server applies a changed ack_wait,
        max_deliver or filter) and bind a pull subscription to it."""
        try:
            await self._js.add_consumer(stream, config=config)
            durable = str(config.durable_name)
            return await self._js.pull_subscribe_bind(durable=durable, stream=stream)
        except nats.js.errors.APIError as exc:
            raise _api_error(exc, what) from exc
        except TRANSIENT_ERRORS as exc:
            raise Unavailable(f"{what}: no answer from JetStream ({type(exc).__name__})") from exc

    async def _fetch(self, sub: Any, batch: int, timeout_s: float, what: str) -> list[Msg] | None:
        """One fetch; [] when nothing arrived in time or the connection is being re-made, None
        when this Bus was closed (the iteration ends)."""
        try:
            return list(await sub.fetch(batch, timeout=timeout_s))
        except TimeoutError:
            return None if self._closing else []
        except nats.errors.ConnectionClosedError as exc:
            if self._closing:
                return None
            raise Unavailable(f"{what}: the NATS connection is closed") from exc
        except TRANSIENT_ERRORS:  # (TimeoutError is the clause above)
            await asyncio.sleep(min(timeout_s, 0.5))
            return []
        except nats.js.errors.APIError as exc:
            description = (exc.description or "").lower()
            # Transient answers: a request timed out, no responder (a 503 status, which nats-py
            # raises without a code), the consumer's leader changing.
            unavailable = isinstance(exc, nats.js.errors.ServiceUnavailableError)
            if unavailable or exc.code in (408, 503) or "leadership" in description:
                log.debug("%s: fetch answered %s; retrying", what, exc)
                await asyncio.sleep(min(timeout_s, 0.5))
                return []
            raise _api_error(exc, what) from exc
