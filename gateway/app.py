"""The FastAPI application and the uvicorn server that runs it inside a service.

``Gateway`` holds the parts (backend pool, authenticator, serving classes); ``build_app``
wires them into FastAPI with the middleware every route shares: the body-size limit (413), the
body read timeout (408), Prometheus request metrics and an OpenTelemetry SERVER span per request
(its context, taken from the caller's ``traceparent``, is current while the sampler calls run,
so their CLIENT spans and the sampler's SERVER spans join the same trace). ``HttpServer`` runs
uvicorn on the service's event loop without taking over its signal handling (the service's stop
event stops it), with the connection limits of the settings: idle and header timeouts and the
header size limit (``GuardedH11Protocol``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import h11
import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway import metrics
from gateway.auth import Authenticator
from gateway.backends import BackendPool, Replica, SamplerReplica
from gateway.errors import ApiError, BodyTooLarge, RequestTimeout
from gateway.openai.routes import authenticate, param_of, router
from gateway.openai.serving_chat import OpenAIServingChat
from gateway.openai.serving_completion import OpenAIServingCompletion
from gateway.settings import GatewaySettings, Limits
from gateway.training.routes import router as sessions_router
from gateway.training.trainer import AgentTrainer
from services import telemetry
from services.errors import ConfigError

__all__ = ["Gateway", "GuardedH11Protocol", "HttpServer", "build_app"]

log = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_SESSIONS = "/rlfleet/v1/sessions"  # every session route's label


@dataclass
class Gateway:
    pool: BackendPool
    auth: Authenticator
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    limits: Limits
    settings: GatewaySettings
    training: AgentTrainer | None = None  # the training mode, started by the service

    @classmethod
    def create(
        cls,
        settings: GatewaySettings,
        replicas: list[Replica] | None = None,
        *,
        addresses: list[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Gateway:
        """From settings, over ``replicas`` (tests) or SamplerReplicas at ``addresses``."""
        if replicas is None:
            replicas = [
                SamplerReplica(a, timeout_s=settings.request_timeout_s) for a in addresses or []
            ]
        pool = BackendPool(
            replicas,
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
            max_attempts=settings.max_attempts,
            request_timeout_s=settings.request_timeout_s,
        )
        kw: dict[str, Any] = {
            "served_model_name": settings.served_model_name,
            "limits": settings.limits,
        }
        return cls(
            pool=pool,
            auth=Authenticator(
                settings.api_keys,
                environ,
                max_failures=settings.auth_max_failures,
                failure_window_s=settings.auth_failure_window_s,
            ),
            completion=OpenAIServingCompletion(pool, **kw),
            chat=OpenAIServingChat(pool, **kw),
            limits=settings.limits,
            settings=settings,
        )


class _TooLarge(HTTPException):
    pass


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``, by Content-Length or while a chunked body is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> BodyTooLarge:
        return BodyTooLarge(
            f"the request body is larger than {self.max_bytes} bytes", code="body_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await self._error().response()(scope, receive, send)
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, self._error().message)
            return message

        await self.app(scope, limited, send)


class BodyTimeoutMiddleware:
    """408 when the body has not all arrived ``timeout_s`` after the request began (the end
    of its headers). Only reads of the body are timed: once it is complete, ``receive`` waits
    for the client's disconnect as long as the response lasts."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        complete = False

        async def timed() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body did not arrive within {self.timeout_s:g}s"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, timed, send)


class ObservabilityMiddleware:
    """Request counts, latency (to the last byte) and a SERVER span per HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in _ROUTES:
            route = path
        elif path.startswith("/v1/models/"):
            route = "/v1/models"
        elif path.startswith(_SESSIONS):
            route = _SESSIONS
        else:
            route = "other"
        status = 500
        started = time.monotonic()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        span_cm: Any = contextlib.nullcontext()
        if telemetry.tracing_enabled():
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            span_cm = telemetry.tracer().start_as_current_span(
                f"{scope['method']} {route}",
                context=telemetry.extract(headers),
                kind=SpanKind.SERVER,
                attributes={
                    "http.request.method": scope["method"],
                    "http.route": route,
                    "url.path": path,
                },
            )
        with span_cm as span:
            try:
                await self.app(scope, receive, send_status)
            finally:
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                if route not in ("/metrics", "/health"):
                    metrics.REQUESTS.labels(route, str(status)).inc()
                    metrics.REQUEST_SECONDS.labels(route).observe(time.monotonic() - started)


def build_app(gateway: Gateway, *, cors_origins: list[str] | None = None) -> FastAPI:
    app = FastAPI(title="rlfleet gateway", docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.include_router(router)
    app.include_router(sessions_router)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        loc = tuple(first.get("loc", ()))
        loc = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc
        return ApiError(
            str(first.get("msg")), status=400, type="invalid_request_error", param=param_of(loc)
        ).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "body_too_large" if exc.status_code == 413 else None
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return ApiError(
            message, status=exc.status_code, type=kind, code=code, headers=dict(exc.headers or {})
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return ApiError(f"internal error: {type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        pool = gateway.pool
        backends = [
            {
                "address": b.address,
                "healthy": b.healthy,
                "outstanding": b.outstanding,
                "error": None if b.healthy else b.last_error,
            }
            for b in pool.backends
        ]
        ok = bool(pool.healthy_backends())
        body = {"status": "ok" if ok else "unavailable", "backends": backends}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        access = gateway.settings.metrics_access
        if access == "off":
            raise HTTPException(404)
        if access == "key":
            authenticate(request)  # open when no keys are configured, like every route
        data = prometheus_client.generate_latest(prometheus_client.REGISTRY)
        return Response(data, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    # Outermost first: metrics/tracing see the 413s, 408s and every status.
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=gateway.settings.body_timeout_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=gateway.limits.max_body_bytes)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(ObservabilityMiddleware)
    return app


class _Config(uvicorn.Config):
    """uvicorn's settings plus the two timeouts ``GuardedH11Protocol`` adds."""

    header_timeout_s: float | None = None
    body_timeout_s: float | None = None


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines it lacks. uvicorn arms its keep-alive timer
    only after a response and any byte cancels it, so a connection that never sends a request,
    or sends its headers a byte at a time, stays open for ever; and a body the app did not wait
    for (a 401 is sent before the body is read) may trickle in for ever after the response.
    Here a new connection gets the idle timeout too, a request's head must be complete within
    ``header_timeout_s`` of its first byte, and the rest of an unread body must arrive within
    ``body_timeout_s`` of the response; past a deadline the connection is closed."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout_s: float | None = getattr(config, "header_timeout_s", None)
        self.body_timeout_s: float | None = getattr(config, "body_timeout_s", None)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: str | None = None  # "head" or "body"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:
            # No request head complete yet: its clock starts at its first byte, and later
            # bytes do not restart it.
            if self._deadline is None:
                self._arm("head", self.header_timeout_s)
        elif not (state is h11.SEND_BODY and self._deadline_for == "body"):
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        unread = self.conn.their_state is h11.SEND_BODY
        super().on_response_complete()
        if unread and self.conn.their_state is h11.SEND_BODY:
            self._cancel_deadline()
            self._arm("body", self.body_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _arm(self, what: str, timeout_s: float | None) -> None:
        if timeout_s is not None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(timeout_s, self._expired)
            self._deadline_for = what

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._deadline_for = None

    def _expired(self) -> None:
        self._deadline = self._deadline_for = None
        if not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()  # the service owns SIGTERM/SIGINT (ctx.stop_event)


class HttpServer:
    """uvicorn on a socket bound up front (port 0 picks a free one, known before serving).

    The socket is made with ``proto=IPPROTO_TCP`` (and TCP_NODELAY, which Linux passes on to
    accepted connections): asyncio turns Nagle's algorithm off only on sockets whose ``proto``
    says TCP, and a bare ``socket(family, SOCK_STREAM)`` has proto 0. With Nagle on, an SSE
    body chunk written while the response headers were still unacknowledged waited for the
    client's delayed ACK, so the first tokens arrived late and in one burst.
    """

    def __init__(
        self,
        app: FastAPI,
        settings: GatewaySettings,
        *,
        host: str | None = None,
        port: int | None = None,
    ) -> None:
        """Listens on ``host``:``port`` (default: the settings' ``http_host``, ``http_port``)."""
        host = settings.http_host if host is None else host
        port = settings.http_port if port is None else port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.socket.bind((host, port))
        except OSError as exc:
            self.socket.close()
            raise ConfigError(
                f"http_port: cannot listen on {host}:{port} ({exc.strerror}); set another port"
            ) from None
        self.socket.listen(2048)
        self.socket.setblocking(False)
        self.host = host
        self.port = int(self.socket.getsockname()[1])
        config = _Config(
            app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            # h11, not httptools: only h11 bounds the size of a request head.
            http=GuardedH11Protocol,
            timeout_keep_alive=settings.idle_timeout_s,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=settings.max_header_bytes,
            limit_concurrency=settings.max_connections,
        )
        config.header_timeout_s = settings.header_timeout_s
        config.body_timeout_s = settings.body_timeout_s
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]), name="http")
        while not self.server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._task = None
        self.socket.close()
