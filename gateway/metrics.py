"""Prometheus collectors of the gateway (``rlfleet_gateway_*``), served at ``/metrics`` on the
HTTP port and on the runtime's metrics port (same registry)."""

from __future__ import annotations

from services.telemetry import metrics

__all__ = [
    "BACKEND_ERRORS",
    "BACKEND_HEALTHY",
    "BACKEND_OUTSTANDING",
    "BACKEND_REQUESTS",
    "COMPLETION_TOKENS",
    "FAILOVERS",
    "IN_FLIGHT",
    "PROMPT_TOKENS",
    "RATE_LIMITED",
    "REQUESTS",
    "REQUEST_SECONDS",
    "TTFT_SECONDS",
]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = metrics.counter(
    "gateway_requests_total",
    "HTTP requests answered, by route and status code.",
    ("route", "status"),
)
REQUEST_SECONDS = metrics.histogram(
    "gateway_request_seconds",
    "Time from request to the last byte of the response (stream lifetime for streams).",
    ("route",),
    buckets=_LATENCY,
)
TTFT_SECONDS = metrics.histogram(
    "gateway_ttft_seconds",
    "Time from request to the first generated token leaving the sampler.",
    ("route",),
    buckets=_LATENCY,
)
IN_FLIGHT = metrics.gauge("gateway_in_flight_requests", "Generation requests being served.")
PROMPT_TOKENS = metrics.counter(
    "gateway_prompt_tokens_total", "Prompt tokens of served requests.", ("route",)
)
COMPLETION_TOKENS = metrics.counter(
    "gateway_completion_tokens_total", "Tokens generated for served requests.", ("route",)
)
RATE_LIMITED = metrics.counter(
    "gateway_rate_limited_total",
    "Requests refused by a key's rate limit (key unauthenticated, limit failed_auth: from an "
    "address locked out for wrong keys).",
    ("key", "limit"),
)
BACKEND_OUTSTANDING = metrics.gauge(
    "gateway_backend_outstanding", "Sampler streams open on each backend.", ("backend",)
)
BACKEND_HEALTHY = metrics.gauge(
    "gateway_backend_healthy", "1 while the backend is in rotation.", ("backend",)
)
BACKEND_REQUESTS = metrics.counter(
    "gateway_backend_requests_total", "Sampler streams opened on each backend.", ("backend",)
)
BACKEND_ERRORS = metrics.counter(
    "gateway_backend_errors_total",
    "Failed sampler streams, by backend and gRPC code.",
    ("backend", "code"),
)
FAILOVERS = metrics.counter(
    "gateway_failovers_total", "Requests moved to another backend before streaming started."
)
