"""The `serve` job: `job: {kind: serve, model: exports/..., replicas: 2, ...}` in a run file.

Expands into `sampler-<i>` (kind `sampler`, serving the model folder: no learner, no weight
following) and `gateway` (the run's main service) in front of them. Pure pydantic: importing
this imports neither vLLM nor FastAPI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field

from gateway.settings import DEFAULT_HTTP_PORT, ApiKey, Limits
from services.config import StrictModel
from services.registry import JobSpec

__all__ = ["SERVE_JOB", "ServeJobSettings"]


class ServeJobSettings(StrictModel):
    """Serve a model folder (e.g. what `rlfleet export` wrote) over the OpenAI API."""

    aliases: ClassVar[Mapping[str, str]] = {
        "model_path": "model",
        "model_name_or_path": "model",
        "num_replicas": "replicas",
        "data_parallel_size": "replicas",
        "num_instances": "replicas",
        "api_key": "use api_keys: [{key: ...}] or [{key_env: ...}]",
        "gpu_memory_utilization": "use kv_cache_gib (the KV cache in GiB, per replica)",
        "max_num_batched_seqs": "max_num_seqs",
        "bind": "host",
        "http_port": "port",
        "http_host": "host",
    }

    model: str = Field(
        min_length=1, description="Hugging Face model folder to serve (or a hub id when online)"
    )
    replicas: int = Field(
        default=1,
        ge=1,
        description="sampler replicas (one inference engine each) behind the gateway",
    )
    engine: Literal["vllm", "hf"] = Field(
        default="vllm", description="inference engine of the replicas"
    )
    served_model_name: str | None = Field(
        default=None, description="model name clients send in requests (default: the folder's name)"
    )
    host: str = Field(default="127.0.0.1", description="HTTP bind address of the gateway")
    port: int = Field(
        default=DEFAULT_HTTP_PORT,
        ge=0,
        le=65535,
        description="HTTP port of the gateway (0: any free port)",
    )
    api_keys: list[ApiKey] = Field(
        default_factory=list,
        description="accepted Bearer keys with their rate limits (empty: no authentication)",
    )
    limits: Limits = Field(
        default_factory=Limits,
        description="per-request limits the gateway checks before calling a replica",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="bfloat16", description="weights and activations dtype"
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="context length in tokens (default: the model's)"
    )
    kv_cache_gib: int = Field(default=1, ge=1, description="KV cache size per replica, in GiB")
    max_num_seqs: int = Field(default=256, ge=1, description="sequences a replica batches at once")
    max_n: int = Field(
        default=16, ge=1, description="most completions per request (n) a replica accepts"
    )
    enforce_eager: bool = Field(
        default=True,
        description="run the engine eagerly (no CUDA graphs: faster start, slower decode)",
    )
    seed: int = Field(default=0, ge=0, description="base sampling seed (replica i gets seed + i)")
    sampler: dict[str, Any] = Field(
        default_factory=dict, description="extra sampler settings, passed to every replica"
    )
    gateway: dict[str, Any] = Field(default_factory=dict, description="extra gateway settings")
    restarts: int = Field(
        default=3, ge=0, description="restarts of each service before the run fails"
    )

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
