"""Traces and metrics shared by every service.

Tracing is OpenTelemetry, off by default: with ``exporter="none"`` nothing is installed, the
server skips span work with one flag check and channels get no tracing interceptor at all, so a
service that does not trace pays nothing. When on, one span per RPC (server and client side) and
the W3C ``traceparent`` travels in gRPC metadata and in NATS headers (``inject``/``extract``), so
a trajectory can be followed from the sampler through the bus to the learner.

Only opentelemetry-api/sdk are used; the OTLP exporter is imported when asked for, and the gRPC
hooks are written here (opentelemetry-instrumentation-grpc does not cover grpc.aio streams well).

Metrics are Prometheus (``start_metrics_server`` serves ``/metrics``); ``metrics`` creates
collectors idempotently under the ``rlfleet_`` prefix so modules can declare them at import time
and tests can import modules twice.

The gRPC client and server hooks are here with the tracer they use, so the whole tracing path
(setup, propagation, spans on both ends) reads in one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
import prometheus_client
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client.metrics import MetricWrapperBase

from services.errors import ConfigError, code_of

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import SpanProcessor

__all__ = [
    "Metrics",
    "add_call_metadata",
    "bus_span",
    "client_interceptors",
    "extract",
    "inject",
    "metrics",
    "per_kind_interceptors",
    "server_rpc_scope",
    "setup_tracing",
    "shutdown_tracing",
    "start_metrics_server",
    "tracer",
    "tracing_enabled",
]

_TRACER_NAME = "rlfleet.services"

_lock = threading.Lock()
_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider once tracing was set up
_tracer: trace.Tracer = trace.NoOpTracer()
_enabled = False


# --------------------------------------------------------------------------- tracing setup


def setup_tracing(service_name: str, exporter: Any = "none", endpoint: str | None = None) -> None:
    """Turn tracing on for this process, exporting spans to ``exporter``.

    ``exporter`` is ``"none"`` (the default: tracing off, zero overhead), ``"console"`` (spans
    printed to stdout), ``"otlp"`` (OTLP/gRPC to ``endpoint`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``;
    needs the ``otlp`` extra), or an SDK ``SpanExporter`` instance (tests). The first call sets
    the global tracer provider and the service name; later calls add exporters to it, because
    OpenTelemetry allows the global provider to be set only once per process.
    """
    global _provider, _tracer, _enabled
    if exporter == "none":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
        SpanExporter,
    )

    processor: SpanProcessor
    if exporter == "console":
        processor = SimpleSpanProcessor(ConsoleSpanExporter(service_name=service_name))
    elif exporter == "otlp":
        processor = BatchSpanProcessor(_otlp_exporter(endpoint))
    elif isinstance(exporter, SpanExporter):
        # Synchronous export, so a test sees its spans as soon as they end.
        processor = SimpleSpanProcessor(exporter)
    else:
        raise ConfigError(
            f"unknown tracing exporter {exporter!r}; expected 'none', 'console' or 'otlp'",
            field="exporter",
        )
    with _lock:
        if _provider is None:
            _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            trace.set_tracer_provider(_provider)
            _tracer = _provider.get_tracer(_TRACER_NAME)
        _provider.add_span_processor(processor)
        _enabled = True


def _otlp_exporter(endpoint: str | None) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ImportError(
            "tracing exporter 'otlp' needs the package opentelemetry-exporter-otlp-proto-grpc "
            "(pip install 'rlfleet[otlp]')"
        ) from exc
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def tracing_enabled() -> bool:
    """Whether setup_tracing installed an exporter (and tracing has not been shut down)."""
    return _enabled


def tracer() -> trace.Tracer:
    """The rlfleet tracer (a no-op tracer while tracing is off)."""
    return _tracer if _enabled else trace.NoOpTracer()


def shutdown_tracing() -> None:
    """Flush pending spans and stop creating new ones; call before a service exits."""
    global _enabled
    with _lock:
        _enabled = False
        if _provider is not None:
            _provider.force_flush()


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (W3C ``traceparent``) to ``headers`` and return them.

    Used for NATS message headers; a no-op while tracing is off.
    """
    if _enabled:
        propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context carried by ``headers`` (NATS headers or gRPC metadata as a dict)."""
    return propagate.extract(dict(headers) if headers else {})


@contextlib.contextmanager
def bus_span(
    operation: str, subject: str, headers: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Trace one bus message: a PRODUCER span around ``"publish"`` (the headers it injects name
    this span, so the message carries it), a CONSUMER span for ``"receive"`` that continues the
    trace of the ``headers`` the message came with. So a fragment's trip from an actor through
    NATS to the learner is one trace, and the gap between the two spans is its time in the
    stream. Nothing is done while tracing is off."""
    if not _enabled:
        yield
        return
    kind = SpanKind.PRODUCER if operation == "publish" else SpanKind.CONSUMER
    attributes = {
        "messaging.system": "nats",
        "messaging.operation.type": operation,
        "messaging.destination.name": subject,
    }
    parent = extract(headers) if headers is not None else None
    with _tracer.start_as_current_span(
        f"{operation} {subject}", context=parent, kind=kind, attributes=attributes
    ):
        yield


# --------------------------------------------------------------------------- metrics


_CollectorT = TypeVar("_CollectorT", bound=MetricWrapperBase)


class Metrics:
    """Idempotent factory for Prometheus collectors named ``rlfleet_<name>``.

    Asking twice for the same name returns the same collector, so a module can declare its
    metrics at import time even when imported twice; asking for the same name with another
    type or other labels is a programming error and raises ValueError.
    """

    PREFIX = "rlfleet_"

    def __init__(self, registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self._registry = registry or prometheus_client.REGISTRY
        self._collectors: dict[str, tuple[type, tuple[str, ...], MetricWrapperBase]] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> prometheus_client.Counter:
        return self._get(prometheus_client.Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> prometheus_client.Gauge:
        return self._get(prometheus_client.Gauge, name, doc, labels)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] | None = None,
    ) -> prometheus_client.Histogram:
        extra = {"buckets": tuple(buckets)} if buckets is not None else {}
        return self._get(prometheus_client.Histogram, name, doc, labels, **extra)

    def _get(
        self, kind: type[_CollectorT], name: str, doc: str, labels: Sequence[str], **kwargs: Any
    ) -> _CollectorT:
        full = name if name.startswith(self.PREFIX) else self.PREFIX + name
        labels = tuple(labels)
        with self._lock:
            known = self._collectors.get(full)
            if known is not None:
                known_kind, known_labels, collector = known
                if known_kind is not kind or known_labels != labels:
                    raise ValueError(
                        f"metric {full} already registered as {known_kind.__name__}"
                        f"{list(known_labels)}, asked for {kind.__name__}{list(labels)}"
                    )
                return cast(_CollectorT, collector)  # known_kind is kind, checked above
            collector = kind(full, doc, labels, registry=self._registry, **kwargs)
            self._collectors[full] = (kind, labels, collector)
            return collector


metrics = Metrics()

_metrics_servers: list[Any] = []


def start_metrics_server(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve Prometheus ``/metrics`` from a daemon thread; returns the bound port.

    Port 0 lets the OS pick a free port at bind time (no probe-then-bind race).
    """
    server, _thread = prometheus_client.start_http_server(port, addr=host)
    _metrics_servers.append(server)  # keep it referenced for the life of the process
    return int(server.server_port)


# Sub-millisecond buckets too: a loopback unary RPC takes a few hundred microseconds.
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)


_HANDLED = metrics.counter(
    "grpc_server_handled_total",
    "RPCs completed on the server, by method and status code.",
    ("method", "code"),
)
_HANDLING_SECONDS = metrics.histogram(
    "grpc_server_handling_seconds",
    "Time from the start of an RPC to its end on the server (stream lifetime for streams).",
    ("method",),
    buckets=_RPC_BUCKETS,
)


# --------------------------------------------------------------------------- gRPC hooks


# Probed every few seconds by every pool, launcher and kubelet: a trace each would drown the rest.
_UNTRACED_PREFIX = "/grpc.health.v1.Health/"


def _span_name(method: str) -> str:
    # "/rlfleet.env.v1.EnvService/Step" -> "rlfleet.env.v1.EnvService/Step" (OTel RPC convention)
    return method.lstrip("/")


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _metadata_carrier(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    return {key: value for key, value in (metadata or ()) if isinstance(value, str)}


def _code_after(
    exc: BaseException | None, context: grpc.aio.ServicerContext[Any, Any]
) -> grpc.StatusCode:
    """The status an RPC ends with, seen from outside its handler."""
    if exc is None:
        return context.code() or grpc.StatusCode.OK
    if isinstance(exc, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.UNKNOWN
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # grpc cancels the handler both when the client goes away and when the deadline passes.
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return code_of(exc)


@contextlib.asynccontextmanager
async def server_rpc_scope(
    method: str,
    metadata: Iterable[tuple[str, Any]] | None,
    context: grpc.aio.ServicerContext[Any, Any],
) -> AsyncIterator[None]:
    """Wrap one server RPC: count and time it, and trace it when tracing is on.

    The span continues the trace whose ``traceparent`` came in the metadata and is the current
    span while the handler runs, so its own spans and the NATS headers it injects join the trace.
    server.py installs this on every server through an interceptor, and runs a streaming
    handler as one coroutine so that this scope is left in the context it was entered in.
    Health checks are counted but not traced.
    """
    started = time.perf_counter()
    span: trace.Span | None = None
    token: Token[Context] | None = None
    if _enabled and not method.startswith(_UNTRACED_PREFIX):
        span = _tracer.start_span(
            _span_name(method),
            context=extract(_metadata_carrier(metadata)),
            kind=SpanKind.SERVER,
            attributes=_rpc_attributes(method),
        )
        token = otel_context.attach(trace.set_span_in_context(span))
    failure: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        failure = exc
        raise
    finally:
        code = _code_after(failure, context)
        _HANDLED.labels(method, code.name).inc()
        _HANDLING_SECONDS.labels(method).observe(time.perf_counter() - started)
        if span is not None:
            _end_span(span, code, failure, context.details() if failure else None)
        if token is not None:
            otel_context.detach(token)


def _end_span(
    span: trace.Span, code: grpc.StatusCode, exc: BaseException | None, details: str | None
) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is grpc.StatusCode.CANCELLED:
        # The caller went away or gave up (a learner's FetchWeights when a newer version came):
        # an outcome, not a failure, so the status stays UNSET.
        span.add_event("cancelled", {"rpc.grpc.status_code": code.value[0]})
        span.end()
        return
    if exc is not None and not isinstance(
        exc, grpc.aio.AbortError | asyncio.CancelledError | GeneratorExit
    ):
        span.record_exception(exc)
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))
    span.end()


def add_call_metadata(
    details: grpc.aio.ClientCallDetails, pairs: Iterable[tuple[str, str]]
) -> grpc.aio.ClientCallDetails:
    """A copy of ``details`` with ``pairs`` added to its metadata (keys already set win)."""
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in pairs:
        # Metadata tests keys; its stub types it as a Collection of (key, value) pairs.
        if key not in metadata:  # type: ignore[comparison-overlap]
            metadata.add(key, value)
    # ClientCallDetails is a namedtuple at runtime; its stub does not declare _replace.
    replaced = details._replace(metadata=metadata)  # type: ignore[attr-defined]
    return cast(grpc.aio.ClientCallDetails, replaced)


ClientIntercept = Callable[[Any, grpc.aio.ClientCallDetails, Any], Awaitable[Any]]


class _Delegating:
    def __init__(self, intercept: ClientIntercept) -> None:
        self._intercept = intercept


class _UnaryUnary(_Delegating, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._intercept(continuation, details, request)


class _UnaryStream(_Delegating, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._intercept(continuation, details, request)


class _StreamUnary(_Delegating, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._intercept(continuation, details, requests)


class _StreamStream(_Delegating, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._intercept(continuation, details, requests)


def per_kind_interceptors(intercept: ClientIntercept) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors running ``intercept(continuation, details, request)`` on every call.

    One object per call kind, because grpc.aio files an interceptor under the first kind it
    implements only: a single class implementing all four would intercept unary-unary calls alone.
    """
    return [
        _UnaryUnary(intercept),
        _UnaryStream(intercept),
        _StreamUnary(intercept),
        _StreamStream(intercept),
    ]


class _ClientTracing:
    """One CLIENT span per call, with the trace context sent in the call's metadata.

    The span ends when the call does (done callback), so streams are timed over their lifetime.
    """

    def __init__(self) -> None:
        self._finishing: set[asyncio.Task[None]] = set()

    async def intercept(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(_UNTRACED_PREFIX):
            return await continuation(details, request)
        span = _tracer.start_span(
            _span_name(method), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method)
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        try:
            call = await continuation(add_call_metadata(details, carrier.items()), request)
        except BaseException as exc:
            _end_span(span, code_of(exc), exc, str(exc))
            raise
        call.add_done_callback(lambda done: self._finish(span, done))
        return call

    def _finish(self, span: trace.Span, call: Any) -> None:
        # aio calls report their code through coroutines; the call is done, so they return at once.
        async def end() -> None:
            _end_span(span, await call.code(), None, await call.details())

        task = asyncio.get_running_loop().create_task(end())
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The telemetry interceptors for a new channel: none at all while tracing is off."""
    return per_kind_interceptors(_ClientTracing().intercept) if _enabled else []
