"""gRPC server bootstrap and client channels, the same for every service.

``GrpcServer`` wraps ``grpc.aio.server`` with what each service would otherwise repeat: the
standard health service (NOT_SERVING until the service says it is ready, which is what the
launcher and Kubernetes probes wait for), reflection (so ``grpcurl`` works without protos),
raised message limits on both ends, graceful stop, and three always-on interceptors:

1. request id: ``x-request-id`` from the caller or a new one, readable through
   ``current_request_id()`` and sent back in the trailing metadata, so one id follows a request
   across services and log lines;
2. telemetry: Prometheus counters/latency per method and code, and a span when tracing is on;
3. exception mapping: an exception escaping a handler becomes a proper status (RlfleetError ->
   its code, anything else -> INTERNAL naming the type) with ``google.rpc.Status`` details,
   instead of grpc's bare UNKNOWN; a request message that cannot be decoded is INVALID_ARGUMENT
   (grpc alone answers UNKNOWN);

and, under mutual TLS with a certificate naming an rlfleet identity, a fourth: caller kinds
(``CallerKindInterceptor``: each servicer's ``CALLERS`` says which kinds may call a method).

``channel()`` builds the matching client side: same limits, keepalive, retries of UNAVAILABLE,
and interceptors that forward the request id and the trace context.

Server and channel share this module because they are two halves of one contract (limits,
retries, request ids, error mapping) that must change together.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services import security, telemetry
from services.errors import (
    REQUEST_ID_KEY,
    InvalidArgument,
    RlfleetError,
    abort_with,
    current_request_id,
    request_id_var,
)
from services.placement import pin_to_assigned_cpus

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "CallerKindInterceptor",
    "ExceptionMappingInterceptor",
    "GrpcServer",
    "RequestIdInterceptor",
    "ScopedServerInterceptor",
    "TelemetryServerInterceptor",
    "channel",
    "current_request_id",
    "install_signal_handlers",
    "sync_channel",
    "wait_for_health",
    "wrap_method_handler",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# --------------------------------------------------------------------------- handler wrapping

# A scope factory gets the servicer context of one call and returns an async context manager
# that encloses the whole call (for streams: until the last response has been produced).
ScopeFactory = Callable[[grpc.aio.ServicerContext[Any, Any]], AbstractAsyncContextManager[Any]]

# The request and response types of one method: handlers pass through the wrapping unchanged.
_RequestT = TypeVar("_RequestT")
_ResponseT = TypeVar("_ResponseT")

_HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def wrap_method_handler(
    handler: grpc.RpcMethodHandler[_RequestT, _ResponseT], scope: ScopeFactory
) -> grpc.RpcMethodHandler[_RequestT, _ResponseT]:
    """A new RpcMethodHandler whose behaviour runs inside ``scope(context)``.

    grpc.aio picks how to drive a behaviour by its kind: a coroutine function, or for streamed
    responses an async generator function or a coroutine that calls ``context.write``. An async
    generator is wrapped as such a coroutine: grpc iterates a generator from its own code and,
    when the call is cancelled while it sends, leaves the generator to be closed by the garbage
    collector in another task, so the scopes (the trace context above all) would be left in a
    context other than the one they were entered in. Synchronous behaviours (run by grpc in a
    thread pool) are returned unwrapped: rlfleet servicers are async.
    """
    kind = next((k for k in _HANDLER_FACTORIES if getattr(handler, k) is not None), None)
    if kind is None:
        return handler
    behaviour = getattr(handler, kind)
    # Only the wrapper closest to the servicer's own behaviour checks for an undecodable
    # request, so the InvalidArgument it raises passes through every scope (mapping, metrics).
    innermost = not getattr(behaviour, _WRAPPED, False)

    if inspect.isasyncgenfunction(behaviour):

        async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            async with scope(context):
                if innermost and isinstance(request, _Undecodable):
                    raise request.error()
                # Closed here, in the call's task, also when the call is cancelled mid-write.
                async with contextlib.aclosing(behaviour(request, context)) as responses:
                    async for response in responses:
                        try:
                            await context.write(response)
                        except grpc.aio.InternalError:
                            # A send fails only when the call is over (the caller left, the
                            # deadline passed, the connection dropped); grpc may report it
                            # before it marks the call cancelled (context.cancelled() False).
                            raise asyncio.CancelledError from None

    elif inspect.iscoroutinefunction(behaviour):

        async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            async with scope(context):
                if innermost and isinstance(request, _Undecodable):
                    raise request.error()
                return await behaviour(request, context)

    else:
        return handler

    setattr(wrapped, _WRAPPED, True)
    return _HANDLER_FACTORIES[kind](
        wrapped,
        request_deserializer=_tolerant_deserializer(
            handler.request_deserializer, streamed=kind.startswith("stream_")
        ),
        response_serializer=handler.response_serializer,
    )


_WRAPPED = "_rlfleet_wrapped"


class _Undecodable:
    """What a unary request that failed to deserialize becomes: the handler wrapper raises
    InvalidArgument for it inside the interceptors' scopes. grpc itself would answer UNKNOWN
    ("Unexpected error"), without details, metrics or request id."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def error(self) -> InvalidArgument:
        return InvalidArgument(
            f"request message cannot be decoded: {type(self.exc).__name__}: {self.exc}",
            field="request",
        )


def _tolerant_deserializer(
    deserializer: Callable[[bytes], Any] | None, *, streamed: bool
) -> Callable[[bytes], Any] | None:
    """``deserializer`` that does not raise grpc's UNKNOWN on bytes it cannot decode.

    Unary requests are decoded before the handler runs: they become an ``_Undecodable`` that
    the wrapper turns into INVALID_ARGUMENT. Streamed requests are decoded inside the handler
    (``context.read()``, the request iterator): they raise InvalidArgument there, which the
    exception mapping sends as INVALID_ARGUMENT.
    """
    if deserializer is None or getattr(deserializer, _WRAPPED, False):
        return deserializer
    decode = deserializer

    def tolerant(raw: bytes) -> Any:
        try:
            return decode(raw)
        except Exception as exc:
            if streamed:
                raise _Undecodable(exc).error() from exc
            return _Undecodable(exc)

    setattr(tolerant, _WRAPPED, True)
    return tolerant


class ScopedServerInterceptor(grpc.aio.ServerInterceptor):
    """Base for server interceptors that enclose each call in an async context manager."""

    def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails],
            Awaitable[grpc.RpcMethodHandler[_RequestT, _ResponseT] | None],
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_RequestT, _ResponseT] | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return handler
        return wrap_method_handler(
            handler, lambda context: self.scope(handler_call_details, context)
        )


# Printable ASCII without spaces, bounded: a caller's id ends up in logs and error details.
_VALID_REQUEST_ID = re.compile(r"[!-~]{1,128}")


class RequestIdInterceptor(ScopedServerInterceptor):
    """Adopt the caller's ``x-request-id`` (or make one), expose it, and echo it back.

    The id goes back in the trailing metadata, not the initial metadata: a call whose response
    headers have arrived is committed and no longer retried by the channel, so sending headers
    early would disable the retries of UNAVAILABLE that the service config promises.
    """

    @contextlib.asynccontextmanager
    async def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        request_id = None
        for key, value in details.invocation_metadata or ():
            if key == REQUEST_ID_KEY and isinstance(value, str):
                request_id = value if _VALID_REQUEST_ID.fullmatch(value) else None
                break
        request_id = request_id or uuid.uuid4().hex
        token = request_id_var.set(request_id)
        # Set first so that a handler's own context.abort(code, details) carries it too.
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
        try:
            yield
            # The handler may have replaced the trailing metadata: keep the id in it.
            trailing = tuple(context.trailing_metadata() or ())
            if all(key != REQUEST_ID_KEY for key, _ in trailing):
                context.set_trailing_metadata((*trailing, (REQUEST_ID_KEY, request_id)))
        finally:
            with contextlib.suppress(ValueError):  # stream closed from another context
                request_id_var.reset(token)


class TelemetryServerInterceptor(ScopedServerInterceptor):
    """Per-method Prometheus metrics and, when tracing is on, a server span per call."""

    def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AbstractAsyncContextManager[None]:
        return telemetry.server_rpc_scope(details.method, details.invocation_metadata, context)


class ExceptionMappingInterceptor(ScopedServerInterceptor):
    """Turn an exception escaping a handler into a status with ``google.rpc.Status`` details."""

    @contextlib.asynccontextmanager
    async def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        try:
            yield
        except grpc.aio.AbortError:
            raise  # the handler ended the call itself
        except Exception as exc:
            if context.done():  # the call already ended (e.g. cancelled): nothing to send
                raise
            if isinstance(exc, RlfleetError):
                log.info(
                    "%s [%s] -> %s: %s", details.method, current_request_id(), exc.code.name, exc
                )
            else:
                log.exception("%s [%s] failed", details.method, current_request_id())
            await abort_with(context, exc)


class CallerKindInterceptor(ScopedServerInterceptor):
    """Who may call what, under mutual TLS with identities (services/security.py): a caller
    whose certificate names another run (or no identity) is refused every method, and one of
    a kind that ``callers`` (full method path -> kinds) does not list for the method called is
    refused that method, both with PERMISSION_DENIED naming the method and the caller."""

    def __init__(self, run: str, callers: Mapping[str, frozenset[str]]) -> None:
        self.run = run
        self.callers = dict(callers)

    @contextlib.asynccontextmanager
    async def scope(
        self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        method = details.method
        pem = next(iter(context.auth_context().get("x509_pem_cert") or ()), b"")
        caller = security.cert_identity(bytes(pem))
        if caller is None or caller.run != self.run:
            who = "no rlfleet identity" if caller is None else f"{caller.uri}"
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: the caller's certificate names {who}, not a service of run "
                f"{self.run!r}",
            )
        assert caller is not None  # abort raised otherwise
        allowed = self.callers.get(method)
        if allowed is not None and caller.kind not in allowed:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: caller kind {caller.kind!r} ({caller.name}) may not call it; "
                f"allowed kinds: {', '.join(sorted(allowed))}",
            )
        yield


# --------------------------------------------------------------------------- server


class GrpcServer:
    """An async gRPC server with health, reflection, limits and the rlfleet interceptors.

    Add services first, then start (or ``async with``)::

        server = GrpcServer("env-a", port=ctx.port)
        name = service_name(env_pb2, "EnvService")  # services/grpc_names.py
        server.add_service(env_pb2_grpc.add_EnvServiceServicer_to_server, servicer, name)
        async with server:
            server.set_serving()
            await server.serve_until(ctx.stop_event)
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        grace_s: float = 5.0,
    ) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.grace_s = grace_s
        self._interceptors = tuple(interceptors)
        self._services: list[tuple[Callable[[Any, Any], None], Any, str]] = []
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self._serving = False
        self._health_update: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``host:port`` to connect to (valid after start)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def service_names(self) -> list[str]:
        return [full_name for _, _, full_name in self._services]

    def add_service(
        self, add_fn: Callable[[Any, Any], None], servicer: Any, full_name: str
    ) -> None:
        """Register a servicer: ``add_fn(servicer, grpc_server)`` runs at start.

        ``full_name`` names it for health and reflection: take it from the descriptor,
        ``services.grpc_names.service_name(env_pb2, "EnvService")``.
        Must come before start: grpc cannot add handlers to a running server.
        """
        if self._server is not None:
            raise RuntimeError(f"{self.name}: add_service({full_name}) after start")
        self._services.append((add_fn, servicer, full_name))

    def _callers(self) -> dict[str, frozenset[str]]:
        """Full method path -> the kinds that may call it, from each servicer's ``CALLERS``
        (services/security.py); the launcher may call every method."""
        out = {}
        for _, servicer, full_name in self._services:
            declared: security.Callers = getattr(servicer, "CALLERS", None) or {}
            for method, kinds in declared.items():
                out[f"/{full_name}/{method}"] = frozenset(kinds) | {security.LAUNCHER_KIND}
        return out

    async def start(self) -> int:
        """Bind and start; health is NOT_SERVING until set_serving(). Returns the bound port."""
        if self._server is not None:
            raise RuntimeError(f"{self.name}: already started")
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # Two servers silently sharing a port would split traffic between them.
            ("grpc.so_reuseport", 0),
            # Accept the keepalive pings that channel() sends, even between calls.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
        ]
        tls = security.tls_files()
        # Our own certificate's identity turns the caller checks on: certificates from another
        # CA (a deployment's own) may carry none, and then every holder is trusted alike.
        own = security.cert_identity(tls.read()[1]) if tls is not None else None
        checks = (CallerKindInterceptor(own.run, self._callers()),) if own is not None else ()
        interceptors = (
            RequestIdInterceptor(),
            TelemetryServerInterceptor(),
            ExceptionMappingInterceptor(),
            *checks,
            *self._interceptors,
        )
        server = grpc.aio.server(interceptors=interceptors, options=options)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for add_fn, servicer, _ in self._services:
            add_fn(servicer, server)
        reflection.enable_server_reflection(
            [
                *self.service_names,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ],
            server,
        )
        address = f"{self.host}:{self.port}"
        try:
            if tls is None:
                bound = server.add_insecure_port(address)
            else:  # mutual TLS: clients without a certificate from the CA are refused
                bound = server.add_secure_port(address, security.server_credentials(tls))
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name}: cannot bind gRPC server to {address}: {exc}") from exc
        if not bound:
            raise RuntimeError(f"{self.name}: cannot bind gRPC server to {address}")
        self.port = bound
        await self._apply_health(self._serving)
        await server.start()
        self._server = server
        log.info(
            "%s: gRPC listening on %s%s (%s)",
            self.name,
            self.address,
            (" with mutual TLS" + (", callers checked by kind" if checks else ""))
            if tls is not None
            else "",
            self.service_names,
        )
        return bound

    def set_serving(self, serving: bool = True) -> None:
        """Report SERVING (or NOT_SERVING) for "" and every added service.

        Synchronous so it can be called from anywhere in the service; the update runs as a task
        on the loop, queued behind earlier updates so they apply in call order.
        """
        self._serving = serving
        if serving:
            pin_to_assigned_cpus()  # started up: onto the CPUs `rlfleet up` chose, if any
        if self._server is None:
            return  # start() applies it
        previous = self._health_update

        async def update() -> None:
            if previous is not None:
                await previous
            await self._apply_health(serving)

        self._health_update = asyncio.get_running_loop().create_task(update())

    async def _apply_health(self, serving: bool) -> None:
        status = _SERVING if serving else _NOT_SERVING
        for service in ("", *self.service_names):
            await self._health.set(service, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop: report NOT_SERVING, refuse new calls, let calls in flight finish for grace_s."""
        server, self._server = self._server, None
        if server is None:
            return
        grace = self.grace_s if grace_s is None else grace_s
        if self._health_update is not None:
            await self._health_update
        await self._health.enter_graceful_shutdown()
        await server.stop(grace)
        log.info("%s: gRPC server stopped", self.name)

    async def serve_until(self, stop_event: asyncio.Event) -> None:
        """Run (starting if needed) until ``stop_event`` is set, then stop gracefully."""
        if self._server is None:
            await self.start()
        try:
            await stop_event.wait()
        finally:
            await self.stop()

    async def __aenter__(self) -> GrpcServer:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def install_signal_handlers(stop_event: asyncio.Event) -> None:
    """On SIGTERM/SIGINT set ``stop_event`` (graceful stop); a second signal stops at once.

    Must be called from the main thread with the service's loop running.
    """
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop_event.is_set():
            # Second Ctrl-C / SIGTERM: give the signal back its default action and re-raise it.
            loop.remove_signal_handler(sig)
            signal.raise_signal(sig)
            return
        log.info("received %s: stopping", sig.name)
        stop_event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


# --------------------------------------------------------------------------- client


def _retry_service_config() -> str:
    # Retries apply to every method; grpc only retries a call before any response arrived, so
    # for streams this covers connection failures and an immediate UNAVAILABLE only.
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{}],
                    "retryPolicy": {
                        "maxAttempts": 4,
                        "initialBackoff": "0.1s",
                        "maxBackoff": "2s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


async def _send_request_id(continuation: Any, details: Any, request: Any) -> Any:
    """Client side: send the caller's ``x-request-id``, else the one of the RPC being handled
    (so one id follows a request from service to service), else a new one."""
    request_id = current_request_id() or uuid.uuid4().hex
    return await continuation(
        telemetry.add_call_metadata(details, [(REQUEST_ID_KEY, request_id)]), request
    )


def channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Iterable[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` with rlfleet's limits, retries and metadata; mutual
    TLS when the environment names certificates (services/security.py), else plaintext.

    ``options`` and ``interceptors`` add to (and for options, override) the defaults.
    """
    defaults = {
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.enable_retries": 1,
        "grpc.service_config": _retry_service_config(),
        "grpc.keepalive_time_ms": 30_000,
        "grpc.keepalive_timeout_ms": 10_000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
        # A restarted service is back within seconds; grpc's default backoff grows to 120 s.
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 5_000,
    }
    defaults.update(dict(options))
    chain = [
        *telemetry.per_kind_interceptors(_send_request_id),
        *telemetry.client_interceptors(),
        *interceptors,
    ]
    tls = security.tls_files()
    if tls is None:
        return grpc.aio.insecure_channel(
            address, options=list(defaults.items()), interceptors=chain
        )
    return grpc.aio.secure_channel(
        address,
        security.channel_credentials(tls),
        options=list(defaults.items()),
        interceptors=chain,
    )


def sync_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel (health checks, tools) with the same TLS choice as `channel`."""
    tls = security.tls_files()
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, security.channel_credentials(tls), options=list(options))


def wait_for_health(address: str, timeout_s: float, service: str = "") -> None:
    """Block until ``address`` reports SERVING for ``service`` (standard gRPC health).

    Used by the launcher after starting a service process. Raises TimeoutError naming the
    address and the last answer seen.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    last = "no answer"
    # Reconnect quickly: grpc's default backoff (1 s, growing) would add seconds to start-up.
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 500)]
    with sync_channel(address, options) as health_channel:
        stub = health_pb2_grpc.HealthStub(health_channel)
        # types-grpcio-health-checking declares HealthStub without the method attributes the
        # generated class sets in __init__; this is the type the generated code gives Check.
        check: grpc.UnaryUnaryMultiCallable[
            health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        ] = stub.Check  # type: ignore[attr-defined]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"gRPC health of {address} (service {service!r}) not SERVING after "
                    f"{timeout_s:g}s; last: {last}"
                )
            try:
                reply = check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(remaining, 1.0)
                )
                if reply.status == _SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
