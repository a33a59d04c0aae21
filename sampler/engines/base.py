"""The engine protocol: what the language-model sampler needs from a generation engine.

Engines see token ids only; tokenization and chat templates happen once, in the service
(sampler/lm/requests.py), so every engine generates from exactly the same prompt. A prompt with
images also comes with the images and its ids before expansion (PromptImages): the service's ids
hold each image's tokens as the model's processor expands them, which is what the model sees.
Engines are found by name in ENGINES ("vllm", "hf"), which maps each name to its factory's
import path, so adding an engine never touches the service and the service never imports an
engine it does not run.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENGINES",
    "Completion",
    "Delta",
    "EngineConfig",
    "EngineInfo",
    "GenerationEngine",
    "PromptCounts",
    "PromptImages",
    "SamplingOptions",
    "build_engine",
]

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingOptions:
    """One request's sampling parameters, already validated and defaulted by the service.

    `max_tokens` is per prompt (cut to the room left in the context by the service), hence a
    list aligned with the prompts. `deadline` is a time.monotonic() value: unfinished
    completions stop there with finish reason "abort" and keep the tokens generated so far.
    """

    max_tokens: Sequence[int]
    n: int = 1  # > 1 only with temperature > 0 (the service repeats a greedy answer itself)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    deadline: float | None = None
    # ("json_schema", the schema's JSON text) or ("json_object", ""): the completion's format,
    # for engines whose EngineInfo says structured_output; None: free text.
    structured_output: tuple[str, str] | None = None
    # Tokens never to sample: their logits get common.images.IMAGE_TOKEN_BIAS (a vision-language
    # model's image markers), also in the logprobs reported.
    suppressed_token_ids: tuple[int, ...] = ()
    # `stream`: new tokens per Delta after the first (GenerateStreamRequest.stream_interval).
    stream_interval: int = 1


@dataclass(frozen=True)
class PromptImages:
    """The images of one prompt, in the order the prompt shows them. ``placeholder_ids`` is the
    prompt with one image token per image, before the processor expanded each: engines that
    expand images themselves (vLLM) take that form."""

    images: tuple[Any, ...]  # decoded once by the service (PIL images, RGB)
    placeholder_ids: tuple[int, ...]


@dataclass
class Completion:
    """One completion: token ids [T]; logprobs [T] when asked; top-k ids and logprobs [T][K]."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # Prompt tokens served from the engine's prefix cache (the same for every completion of one
    # prompt); 0 for an engine without one.
    cached_prompt_tokens: int = 0


@dataclass
class PromptCounts:
    """Prompt tokens an engine has prefilled since it started, and how many of them it found in
    its prefix cache (cumulative; readers take differences)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0

    def add(self, prompt_tokens: int, cached_prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_prompt_tokens


@dataclass
class Delta:
    """Tokens one completion (`index`) gained since its previous Delta, for streaming.

    `finish_reason` is set on the completion's last Delta (None before). The text is the
    service's job (it decodes the accumulated tokens and holds back stop-string prefixes)."""

    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What GetInfo reports about the engine."""

    kind: str  # "vllm" | "hf"
    version: str  # e.g. "vllm 0.32.0"
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    prefix_caching: bool = False  # whether repeated prompt prefixes skip their prefill
    structured_output: bool = False  # whether it takes SamplingOptions.structured_output
    max_images: int = 0  # images one prompt may hold (0: the engine reads text only)


# The weight dtypes an engine runs in (SamplerSettings.dtype); every engine takes all three.
EngineDType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine (the service's settings, engine-neutral)."""

    model_path: str
    dtype: EngineDType = "float32"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_n: int = 16
    max_top_logprobs: int = 20
    seed: int = 0
    enforce_eager: bool = True
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 256
    served_model_name: str | None = None
    max_images: int = 0  # per prompt, for a vision-language model
    extra: Mapping[str, Any] = field(default_factory=dict)  # engine-specific arguments


class GenerationEngine(Protocol):
    """A running generation engine. Methods are called from the service's event loop."""

    info: EngineInfo
    counts: PromptCounts  # every request's prompt, Generate and stream alike

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        options: SamplingOptions,
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[list[Completion]]:
        """`options.n` completions per prompt, in prompt order; `images[i]`: prompt i's images
        (only ever given to an engine whose info.max_images allows them). Concurrent calls are
        allowed (and batched together by engines that can)."""
        ...

    def stream(
        self,
        prompt: Sequence[int],
        options: SamplingOptions,
        images: PromptImages | None = None,
    ) -> AsyncIterator[list[Delta]]:
        """One prompt's `options.n` completions as they are generated (`options.max_tokens` has
        one entry): batches of Deltas, every completion ending with a Delta whose finish_reason
        is set. Closing the iterator early (or cancelling the task reading it) aborts the
        generation and frees the engine's slots."""
        ...

    def unfinished_requests(self) -> int:
        """Requests the engine holds now (running or waiting): 0 when idle."""
        ...

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights with Hugging Face-named tensors (a full state dict; a tied
        `lm_head.weight` may be missing). Called only while no generation runs."""
        ...

    async def close(self) -> None:
        """Stop the engine and free its processes and memory."""
        ...


# name -> "module:factory"; a factory is `async (EngineConfig) -> GenerationEngine`. Modules
# import lazily: the hf engine must not pull vLLM in, nor the other way round.
ENGINES: dict[str, str] = {
    "vllm": "sampler.engines.vllm_engine:create",
    "hf": "sampler.engines.hf_engine:create",
}


async def build_engine(name: str, config: EngineConfig) -> GenerationEngine:
    """Start the engine registered as `name`."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})") from None
    module, attr = target.split(":")
    factory: Callable[[EngineConfig], Any] = getattr(importlib.import_module(module), attr)
    return await factory(config)
