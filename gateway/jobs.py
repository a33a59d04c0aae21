"""The `serve` job: `job: {kind: serve, model: exports/..., replicas: 2, ...}` in a run file.

Expands into `sampler-<i>` (kind `sampler`, serving the model folder: no learner, no weight
following) and `gateway` (the run's main service) in front of them. Pure pydantic: importing
this imports neither vLLM nor FastAPI.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.settings import DEFAULT_HTTP_PORT, ApiKey, Limits
from services.config import StrictModel
from services.registry import JobSpec

__all__ = ["SERVE_JOB", "ServeJobSettings"]


class ServeJobSettings(StrictModel):
    """Serve a model folder (e.g. what `rlfleet export` wrote) over the OpenAI API."""

    model: str = Field(min_length=1)  # Hugging Face folder (or hub id when online)
    replicas: int = Field(default=1, ge=1)
    engine: Literal["vllm", "hf"] = "vllm"
    served_model_name: str | None = None  # default: the folder's name
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_HTTP_PORT, ge=0, le=65535)
    api_keys: list[ApiKey] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    max_model_len: int | None = Field(default=None, ge=2)
    kv_cache_gib: int = Field(default=1, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_n: int = Field(default=16, ge=1)
    enforce_eager: bool = True
    seed: int = Field(default=0, ge=0)
    sampler: dict[str, Any] = Field(default_factory=dict)  # extra sampler settings
    gateway: dict[str, Any] = Field(default_factory=dict)  # extra gateway settings
    restarts: int = Field(default=3, ge=0)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]


def expand(settings: ServeJobSettings, run_name: str) -> list[dict[str, Any]]:
    s = settings
    samplers = [f"sampler-{i}" for i in range(s.replicas)]
    entries: list[dict[str, Any]] = []
    for i, name in enumerate(samplers):
        sampler = {
            "model_path": s.model,
            "engine": s.engine,
            "served_model_name": s.model_name,
            "dtype": s.dtype,
            "max_model_len": s.max_model_len,
            "kv_cache_gib": s.kv_cache_gib,
            "max_num_seqs": s.max_num_seqs,
            "max_n": s.max_n,
            "enforce_eager": s.enforce_eager,
            "seed": s.seed + i,
            **s.sampler,
        }
        entries.append(
            {"name": name, "service": "sampler", "restarts": s.restarts, "settings": sampler}
        )
    gateway = {
        "samplers": samplers,
        "http_host": s.host,
        "http_port": s.port,
        "served_model_name": s.model_name,
        "api_keys": [k.model_dump(exclude_none=True) for k in s.api_keys],
        "limits": s.limits.model_dump(),
        **s.gateway,
    }
    entries.append(
        {
            "name": "gateway",
            "service": "gateway",
            "main": True,
            "restarts": s.restarts,
            "settings": gateway,
        }
    )
    return entries


SERVE_JOB = JobSpec(kind="serve", settings=ServeJobSettings, expand=expand)
