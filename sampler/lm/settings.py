"""Settings of the `sampler` kind (YAML `settings:` or RLFLEET_SAMPLER__<KEY>)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, model_validator

from services.config import ServiceRef, StrictModel
from services.server import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["SamplerSettings"]

# An optional ServiceRef; see sampler/actors/settings.py for why it is spelled this way.
OptionalServiceRef = Annotated[str | None, *get_args(ServiceRef)[1:]]


class SamplerSettings(StrictModel):
    """One language-model engine serving SamplerService."""

    model_path: str = Field(min_length=1)  # Hugging Face folder (or hub id when online)
    engine: Literal["vllm", "hf"] = "vllm"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # float32: CPU parity
    max_model_len: int | None = Field(default=None, ge=2)  # None: the model's own limit
    max_n: int = Field(default=16, ge=1)  # SamplingParams.n limit
    max_prompts_per_request: int = Field(default=256, ge=1)
    # Engine requests (one per prompt) admitted and not finished; above it Generate answers
    # RESOURCE_EXHAUSTED rather than queueing without bound.
    max_queued_requests: int = Field(default=4096, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)  # vLLM: sequences per scheduler step
    # Images one prompt may hold, for a vision-language model (vLLM's limit_mm_per_prompt);
    # more is INVALID_ARGUMENT. A text model takes none whatever this says.
    max_images: int = Field(default=4, ge=1)
    kv_cache_gib: int = Field(default=1, ge=1)  # vLLM KV cache (VLLM_CPU_KVCACHE_SPACE on CPU)
    # vLLM's KV block, in tokens (None: vLLM's, 128 on CPU). The prefix cache reuses whole
    # blocks only: smaller ones keep more of short multi-turn conversations (a multiple of 32
    # on CPU).
    block_size: int | None = Field(default=None, ge=16, multiple_of=16)
    enforce_eager: bool = True  # skip torch.compile (a much faster start on CPU)
    seed: int = Field(default=0, ge=0)  # engine seed; requests without a seed draw from it
    # Follow the run's weight versions (WeightsPublished on the bus, fetched from
    # `weights_from`). None: follow exactly when `weights_from` is set.
    follow_run: bool | None = None
    weights_from: OptionalServiceRef = None  # the learner's WeightService
    weights_timeout_s: float = Field(default=600.0, gt=0)  # wait this long for the first one
    served_model_name: str | None = None  # GetInfo.model_name; default: model_path
    # Generate once before reporting SERVING (the first requests of a fresh engine are slow).
    warmup: bool = True
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1 << 20)
    # How tool calls are read back from completions of chat prompts with tools: a vLLM tool
    # parser name (hermes: Qwen2.5 / Hermes <tool_call> blocks, the tiny models' format).
    tool_parser: str = Field(default="hermes", min_length=1)
    # Period of the engine's Metrics events (prefix-cache hit rate, prompt tokens/s, queue).
    metrics_interval_s: float = Field(default=10.0, gt=0)
    # Where vLLM and torch inductor cache what they compile (VLLM_CACHE_ROOT,
    # TORCHINDUCTOR_CACHE_DIR; either variable set already wins). "shared": one cache for every
    # run on the machine, <rlfleet cache>/compile/vllm-<v>-torch-<v>/ ($RLFLEET_CACHE_DIR, else
    # $XDG_CACHE_HOME/rlfleet, else ~/.cache/rlfleet), so a new run reuses what an earlier one
    # compiled (a shorter start-up on CPU); "run": <run dir>/cache/, cold for every new run;
    # any other value: that folder. Sharing is safe: both key their entries by a hash of the
    # code, config and versions (sampler.lm.service.compile_cache_root; docs/platform.md).
    compile_cache: Literal["shared", "run"] | Annotated[str, Field(min_length=1)] = "shared"

    @model_validator(mode="after")
    def _consistent(self) -> SamplerSettings:
        if self.follow_run and not self.weights_from:
            raise ValueError("follow_run needs `weights_from` (the learner's instance name)")
        return self

    @property
    def follows(self) -> bool:
        """Whether this sampler takes its weights from the run's learner."""
        return self.follow_run if self.follow_run is not None else bool(self.weights_from)
