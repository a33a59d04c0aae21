"""Prometheus collectors of the gateway (``rlfleet_gateway_*``, and the OpenTelemetry GenAI
server metrics as ``rlfleet_gen_ai_*``), served at ``/metrics`` on the HTTP port and on the
runtime's metrics port (same registry).

Time to first token is taken where the client sees it: for a stream, when the first chunk
carrying generated tokens has been handed to the ASGI ``send`` (the socket's buffer); for a
non-streaming response, which the client gets all at once, when the first token reached the
gateway from the sampler (label ``stream``). Latency buckets are supersets of the OpenTelemetry
GenAI advisory boundaries, so they aggregate down to them, with more boundaries where
interpolated percentiles of the coarser ones were off by up to 2x.
"""

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
    "QUEUE_SECONDS",
    "RATE_LIMITED",
    "REQUESTS",
    "REQUEST_DURATION",
    "REQUEST_SECONDS",
    "TIME_PER_OUTPUT_TOKEN",
    "TIME_TO_FIRST_TOKEN",
    "TOKEN_USAGE",
    "TTFT_SECONDS",
]

# HTTP latency of every route: the old boundaries (recording rules may name them) and more.
_LATENCY = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 7.5,
    10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600,
)  # fmt: skip
# gen_ai.server.time_to_first_token's boundaries (0.001 ... 10), finer from 0.1 to 5 s, and
# vLLM's tail for long queues.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6,
    0.75, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0,
)  # fmt: skip
# gen_ai.server.time_per_output_token's boundaries (0.01 ... 2.5) with the few-millisecond
# range of fast decoding below them and vLLM's tail above.
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# gen_ai.server.request.duration's boundaries (0.01 x 2^k up to 81.92) with the geometric
# midpoints between them, up to the default request timeout.
DURATION_BUCKETS = (
    0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96,
    1.28, 1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92,
    122.88, 163.84, 245.76, 327.68, 491.52, 655.36,
)  # fmt: skip
# gen_ai.client.token.usage's boundaries (powers of 4).
TOKEN_BUCKETS = tuple(4.0**k for k in range(14))

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
    "Time to first token, streams and not (kept for existing dashboards: the same "
    "observations as rlfleet_gen_ai_server_time_to_first_token_seconds).",
    ("route",),
    buckets=TTFT_BUCKETS,
)
IN_FLIGHT = metrics.gauge(
    "gateway_in_flight_requests",
    "Generation requests being served; a stream until its last byte is sent or its client "
    "goes away.",
)
TIME_TO_FIRST_TOKEN = metrics.histogram(
    "gen_ai_server_time_to_first_token_seconds",
    "gen_ai.server.time_to_first_token: from the request's arrival to its first token reaching "
    "the client (streams: the first chunk with tokens handed to the socket) or, for a "
    "non-streaming response, the gateway.",
    ("route", "stream"),
    buckets=TTFT_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = metrics.histogram(
    "gen_ai_server_time_per_output_token_seconds",
    "gen_ai.server.time_per_output_token: per successful response with two tokens or more, the "
    "time from its first token to its last (as for time to first token) over the tokens after "
    "the first.",
    ("route", "stream"),
    buckets=TPOT_BUCKETS,
)
REQUEST_DURATION = metrics.histogram(
    "gen_ai_server_request_duration_seconds",
    "gen_ai.server.request.duration: generation requests from arrival to the last byte sent "
    "(a stream: or its client going away); error_type is empty on success, else the OpenAI "
    "error type, or client_disconnected.",
    ("route", "stream", "error_type"),
    buckets=DURATION_BUCKETS,
)
TOKEN_USAGE = metrics.histogram(
    "gen_ai_client_token_usage",
    "gen_ai.client.token.usage, as the gateway reports it in each successful response's usage: "
    "tokens per request by token_type (input, output).",
    ("route", "token_type"),
    buckets=TOKEN_BUCKETS,
)
QUEUE_SECONDS = metrics.histogram(
    "gateway_request_queue_seconds",
    "Time from the request's arrival to a sampler starting its stream (one per prompt): "
    "routing, failover and the sampler's admission; the engine's own queue is in the time to "
    "first token (and vLLM's vllm:request_queue_time_seconds).",
    ("route",),
    buckets=TTFT_BUCKETS,
)
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
