"""Settings of the `gateway` kind (YAML `settings:` or RLFLEET_GATEWAY__<KEY>)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from common.images import MAX_IMAGE_BYTES
from services.config import ServiceRef, StrictModel
from services.errors import ConfigError

__all__ = ["DEFAULT_HTTP_PORT", "AgentTraining", "ApiKey", "GatewaySettings", "Limits"]

DEFAULT_HTTP_PORT = 8000  # vLLM's own OpenAI server listens here too


class ApiKey(StrictModel):
    """One accepted Bearer key, given inline (`key`) or read from the environment (`key_env`),
    with its own rate limits (None = unlimited)."""

    key: str | None = Field(default=None, min_length=1, description="the key itself, inline")
    key_env: str | None = Field(
        default=None, min_length=1, description="environment variable holding the key"
    )
    name: str | None = Field(
        default=None, description="label in logs (default: key_env, else key-<i>)"
    )
    rpm: int | None = Field(default=None, ge=1, description="requests per minute (null: unlimited)")
    tpm: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens per minute (null: unlimited)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> ApiKey:
        if (self.key is None) == (self.key_env is None):
            raise ValueError("set exactly one of `key` and `key_env`")
        return self

    def secret(self, environ: Mapping[str, str] | None = None) -> str:
        """The key itself; a `key_env` that is unset or empty is a ConfigError."""
        if self.key is not None:
            return self.key
        env = os.environ if environ is None else environ
        value = env.get(self.key_env or "", "")
        if not value:
            raise ConfigError(f"api_keys: environment variable {self.key_env} is not set")
        return value


class Limits(StrictModel):
    """What one request may ask for. The sampler enforces the model's own limits (context
    length, max_n) too; these are the gateway's, checked before any sampler is called."""

    max_body_bytes: int = Field(
        default=4 << 20, ge=1024, description="largest request body in bytes (413 above)"
    )
    max_prompt_chars: int = Field(
        default=256_000,
        ge=1,
        description="characters per prompt (or per chat), before tokenization",
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="tokens per prompt after tokenization (null: the context length)",
    )
    max_prompts: int = Field(default=64, ge=1, description="prompts in one completions request")
    max_n: int = Field(default=16, ge=1, description="completions per request (n)")
    max_tokens: int | None = Field(
        default=None, ge=1, description="cap on a request's max_tokens (null: the context length)"
    )
    max_stop: int = Field(default=16, ge=0, description="stop strings per request")
    max_json_depth: int = Field(
        default=64,
        ge=4,
        description="deepest nesting of arrays and objects in a request body (400 deeper)",
    )
    max_images: int | None = Field(
        default=None,
        ge=0,
        description="images per chat request (null: as many as the sampler's "
        "max_images_per_prompt; 0: none, 400 for any)",
    )
    max_image_bytes: int = Field(
        default=MAX_IMAGE_BYTES // 2,
        ge=1024,
        le=MAX_IMAGE_BYTES,
        description="one encoded image, from a data URL or fetched (400 above); a data URL "
        "is also part of the body, which max_body_bytes bounds",
    )
    image_url_hosts: list[str] = Field(
        default_factory=list,
        description="hosts whose http(s) image URLs the gateway fetches, by exact name "
        "(empty: data URLs only, 400 for any remote URL)",
    )
    image_fetch_timeout_s: float = Field(
        default=10.0, gt=0, description="time to fetch one remote image (400 past it)"
    )


class AgentTraining(StrictModel):
    """The training mode: agents' sessions are recorded and sent to the learner as groups
    (docs/agents.md). The samplers are the run's training samplers."""

    group_size: int = Field(ge=1, description="sessions per task (a GRPO group)")
    queue: str = Field(default="prompts", min_length=1, description="the run's prompt queue")
    prompt_ack_wait_s: float = Field(
        default=300.0, gt=0, description="a held task returns to the queue after this long"
    )
    task_wait_s: float = Field(
        default=60.0, gt=0, description="a session start waits this long for a task (503 then)"
    )
    session_timeout_s: float = Field(
        default=600.0, gt=0, description="a session not rewarded within this long is dropped"
    )
    max_calls_per_session: int = Field(
        default=32, ge=1, description="model calls per session (a runaway agent is dropped)"
    )
    max_session_tokens: int = Field(
        default=4096, ge=16, description="tokens per session (its episode) before it is dropped"
    )
    groups_per_version: int | None = Field(
        default=None, ge=1, description="groups of this gateway per learner version (pacing)"
    )
    max_policy_lag: int = Field(default=1, ge=0, description="versions a group may lag")
    version_wait_s: float = Field(
        default=300.0, gt=0, description="wait this long for a version before pacing restarts"
    )
    metrics_interval_s: float = Field(default=10.0, gt=0, description="Metrics event period")
    dataset: dict[str, Any] | None = Field(
        default=None,
        description="feed the prompt queue from this dataset spec (as a run's first rollout "
        "driver does; null: something else feeds it)",
    )
    queue_depth: int = Field(default=256, ge=1, description="tasks kept in the queue, fed")


class GatewaySettings(StrictModel):
    """OpenAI HTTP API in front of serving samplers."""

    # Instance names (each: every live replica of it; services/membership.py) or host:port.
    samplers: list[ServiceRef] = Field(min_length=1)
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=DEFAULT_HTTP_PORT, ge=0, le=65535)  # 0: any free port
    served_model_name: str | None = None  # default: the samplers' GetInfo.model_name
    api_keys: list[ApiKey] = Field(default_factory=list)  # empty: no authentication
    limits: Limits = Field(default_factory=Limits)
    request_timeout_s: float = Field(default=600.0, gt=0)  # gRPC deadline of one sampler stream
    health_interval_s: float = Field(default=1.0, gt=0)  # background health check period
    health_timeout_s: float = Field(default=2.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)  # replicas tried before a request fails
    startup_timeout_s: float = Field(default=120.0, gt=0)  # wait for a first healthy sampler
    cors_origins: list[str] = Field(default_factory=list)
    auth_max_failures: int | None = Field(
        default=20,
        ge=1,
        description="wrong API keys one client address may send within auth_failure_window_s; "
        "past that it gets 429 for every request, its key unchecked, until the window has "
        "passed since the lock began (null: no throttling)",
    )
    auth_failure_window_s: float = Field(
        default=60.0,
        gt=0,
        description="window in which auth_max_failures count, and how long the lock lasts",
    )
    metrics_access: Literal["key", "open", "off"] = Field(
        default="key",
        description="`/metrics` on the HTTP port: `key` needs an API key when api_keys are set "
        "(open when none are, like every route), `open` serves anyone, `off` answers 404; the "
        "metrics port (RLFLEET_METRICS_PORT) serves the same registry whatever this says",
    )
    idle_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="an HTTP connection with no request in progress is closed after this long "
        "without a byte, a new one as well as a kept-alive one",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="time from a request's first byte to the end of its headers; "
        "the connection is closed past it",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="time from the end of a request's headers to the end of its body "
        "(408, and the connection closed, past it)",
    )
    max_header_bytes: int = Field(
        default=32 << 10,
        ge=4096,
        description="largest request line plus headers in bytes (400 and the connection "
        "closed above it)",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="open connections plus requests in progress past which new requests get "
        "503 (uvicorn's limit_concurrency; null: no limit)",
    )
    training: AgentTraining | None = Field(
        default=None,
        description="record agents' sessions and train on them (needs the run's bus); null: "
        "serving only",
    )
