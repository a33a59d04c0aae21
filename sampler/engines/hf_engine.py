"""Hugging Face transformers behind the engine protocol: the parity reference and the engine of
small CPU tests.

`model.generate` with `output_scores`: the scores are the processed logits that tokens were
sampled from (after penalties, temperature, top-k/top-p), the same distribution vLLM's
"processed_logprobs" describe. Stopping is done by one StoppingCriteria of ours (eos, stop ids,
stop strings, the request's deadline) with generate's own eos list left empty, so `ignore_eos`
and the finish reasons mean exactly what they mean for vLLM. One generation runs at a time, in
a worker thread (transformers is synchronous). The prompts of one request (with the same token
limit) are one generate call, left-padded: on a small model generate's per-token overhead, not
the arithmetic, is the cost, so prompts one after the other cost nearly one batch each;
requests are not batched with each other. `stream`
sends each completion as one final Delta when its generation ends (correct, not incremental);
closing the stream early stops the generation at its next token.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

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
from services.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["HfEngine", "create"]


def _decode(tokenizer: Any, tokens: list[int]) -> str:
    """The text of one sequence of ids (``decode`` gives a list only for a batch of them)."""
    return cast(str, tokenizer.decode(tokens, skip_special_tokens=True))


async def create(config: EngineConfig) -> HfEngine:
    return await asyncio.to_thread(HfEngine, config)


class HfEngine:
    """One transformers causal LM on CPU (or whatever `extra["device"]` names)."""

    def __init__(self, config: EngineConfig) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        facts = model_facts(config.model_path)
        if facts.vision:
            raise ConfigError(
                f"{config.model_path} is a vision-language model: the hf engine reads text only; "
                "serve it with engine: vllm"
            )
        self.device = str(config.extra.get("device", "cpu"))
        # transformers types PreTrainedModel.to as functools.wraps(nn.Module.to), the unbound
        # function, so mypy takes the device for `self`.
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model_path, dtype=getattr(torch, config.dtype)
        ).to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        max_len = config.max_model_len or facts.max_position_embeddings or 2048
        self.info = EngineInfo(
            kind="hf",
            version=f"transformers {transformers.__version__}",
            max_model_len=int(max_len),
            vocab_size=facts.vocab_size,
            eos_token_ids=facts.eos_token_ids,
        )
        self.counts = PromptCounts()  # no prefix cache: nothing is ever cached
        self._lock = threading.Lock()  # one generate (or weight load) at a time
        self._unfinished = 0  # stream requests not finished (running or waiting for the lock)

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        options: SamplingOptions,
        images: Sequence[PromptImages | None] | None = None,  # never: info.max_images is 0
    ) -> list[list[Completion]]:
        return await asyncio.to_thread(self._generate_all, prompts, options)

    async def stream(
        self,
        prompt: Sequence[int],
        options: SamplingOptions,
        images: PromptImages | None = None,  # never: info.max_images is 0
    ) -> AsyncIterator[list[Delta]]:
        cancel = threading.Event()
        self._unfinished += 1
        try:
            completions = await asyncio.to_thread(self._stream_one, prompt, options, cancel)
        finally:
            cancel.set()  # cancelled: the worker thread stops at its next token
            self._unfinished -= 1
        yield [
            Delta(i, c.token_ids, c.finish_reason, c.logprobs, c.top_token_ids, c.top_logprobs)
            for i, c in enumerate(completions)
        ]

    def _stream_one(
        self, prompt: Sequence[int], options: SamplingOptions, cancel: threading.Event
    ) -> list[Completion]:
        with self._lock:
            if cancel.is_set():
                return []
            return self._generate_batch([prompt], options, options.max_tokens[0], cancel)[0]

    def unfinished_requests(self) -> int:
        return self._unfinished

    def _generate_all(
        self, prompts: Sequence[Sequence[int]], options: SamplingOptions
    ) -> list[list[Completion]]:
        """Each prompt's ``n`` completions: one generate call per distinct token limit."""
        by_limit: dict[int, list[int]] = {}
        for i, limit in enumerate(options.max_tokens):
            by_limit.setdefault(limit, []).append(i)
        out: list[list[Completion]] = [[] for _ in prompts]
        with self._lock:
            for limit, indices in by_limit.items():
                batch = self._generate_batch([prompts[i] for i in indices], options, limit)
                for i, completions in zip(indices, batch, strict=True):
                    out[i] = completions
        return out

    def _generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        o: SamplingOptions,
        max_tokens: int,
        cancel: threading.Event | None = None,
    ) -> list[list[Completion]]:
        """``o.n`` completions of each of ``prompts`` from one generate call: the prompts are
        left-padded to one width (masked, so every real token sees what it would alone), and
        generate repeats each prompt's row ``n`` times, so prompt ``p``'s completions are rows
        ``p * n .. p * n + n - 1``."""
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        if o.deadline is not None and time.monotonic() >= o.deadline:
            return [
                [Completion([], "", "abort", [] if o.logprobs else None) for _ in range(o.n)]
                for _ in prompts
            ]
        self.counts.add(sum(len(p) for p in prompts), 0)
        greedy = o.temperature == 0
        pad_id = self.tokenizer.pad_token_id or 0
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else o.temperature,
            top_p=None if greedy else o.top_p,
            top_k=None if greedy else max(o.top_k, 0),  # 0, not None: None means 50 here
            min_p=None if greedy or o.min_p == 0 else o.min_p,
            repetition_penalty=o.repetition_penalty,
            num_return_sequences=o.n,
            eos_token_id=[],  # stopping is _Stopper's job (see the module docstring)
            pad_token_id=pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [P, W]
        attention_mask = torch.zeros_like(input_ids)  # [P, W]: 0 on the left padding
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
            attention_mask[row, width - len(prompt) :] = 1
        stopper = _Stopper(self, o, width, len(prompts) * o.n, cancel)
        processors = LogitsProcessorList()
        if o.presence_penalty or o.frequency_penalty:
            processors.append(_OpenAIPenalties(width, o))
        if o.seed is not None:
            torch.manual_seed(o.seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([stopper]),
            )
        generated = out.sequences[:, width:].tolist()  # [P * n, T]
        # [T, P * n, V] -> [P * n, T, V]
        logps = torch.stack(out.scores, 1).float().log_softmax(-1) if out.scores else None
        return [
            [
                self._completion(row, generated[row], stopper, logps, o)
                for row in range(p * o.n, (p + 1) * o.n)
            ]
            for p in range(len(prompts))
        ]

    def _completion(
        self,
        row: int,
        tokens: list[int],
        stopper: _Stopper,
        logps: torch.Tensor | None,
        o: SamplingOptions,
    ) -> Completion:
        import torch

        length = stopper.lengths[row] if stopper.lengths[row] is not None else len(tokens)
        tokens = tokens[:length]
        reason = stopper.reasons[row] or "length"
        text = _decode(self.tokenizer, tokens)
        matched = stopper.matched[row]
        if matched is not None:
            text = text[: text.find(matched)]
        completion = Completion(tokens, text, reason)  # type: ignore[arg-type]
        if logps is not None and tokens:
            rows = logps[row, :length]
            if o.logprobs:
                ids = torch.tensor(tokens, device=rows.device)[:, None]
                completion.logprobs = rows.gather(1, ids)[:, 0].tolist()
            if o.top_logprobs:
                values, ids = rows.topk(o.top_logprobs, dim=-1)
                completion.top_token_ids = ids.tolist()
                completion.top_logprobs = values.tolist()
        elif o.logprobs:
            completion.logprobs = []
        return completion

    async def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        await asyncio.to_thread(self._load, tensors)

    def _load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            missing, unexpected = self.model.load_state_dict(dict(tensors), strict=False)
            tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
            if unexpected or set(missing) - tied:
                raise ValueError(
                    f"weights do not fit the model: missing {sorted(set(missing) - tied)}, "
                    f"unexpected {sorted(unexpected)}"
                )

    async def close(self) -> None:
        pass


class _Stopper:
    """StoppingCriteria: per sequence, where and why it stopped (eos, stop id, stop string,
    deadline). generate pads a finished sequence from then on; we cut at `lengths`."""

    def __init__(
        self,
        engine: HfEngine,
        o: SamplingOptions,
        prompt_len: int,
        rows: int,
        cancel: threading.Event | None = None,
    ) -> None:
        self.tokenizer = engine.tokenizer
        self.cancel = cancel
        self.prompt_len = prompt_len
        self.stop_ids = set(o.stop_token_ids)
        if not o.ignore_eos:
            self.stop_ids |= set(engine.info.eos_token_ids)
        self.stop_strings = list(o.stop)
        self.deadline = o.deadline
        self.reasons: list[str | None] = [None] * rows
        self.lengths: list[int | None] = [None] * rows
        self.matched: list[str | None] = [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        import torch

        late = self.deadline is not None and time.monotonic() >= self.deadline
        late = late or (self.cancel is not None and self.cancel.is_set())
        done = []
        for row, ids in enumerate(input_ids.tolist()):
            if self.reasons[row] is None:
                self._check(row, ids[self.prompt_len :], late)
            done.append(self.reasons[row] is not None)
        return torch.tensor(done, device=input_ids.device)

    def _check(self, row: int, tokens: list[int], late: bool) -> None:
        if tokens[-1] in self.stop_ids:
            self.reasons[row], self.lengths[row] = "stop", len(tokens)
        elif self.stop_strings:
            text = _decode(self.tokenizer, tokens)
            hits = [(text.find(s), s) for s in self.stop_strings if s in text]
            if hits:
                self.reasons[row], self.lengths[row] = "stop", len(tokens)
                self.matched[row] = min(hits)[1]
        if self.reasons[row] is None and late:
            self.reasons[row], self.lengths[row] = "abort", len(tokens)


class _OpenAIPenalties:
    """OpenAI presence/frequency penalties over the generated tokens (as vLLM applies them)."""

    def __init__(self, prompt_len: int, o: SamplingOptions) -> None:
        self.prompt_len = prompt_len
        self.presence = o.presence_penalty
        self.frequency = o.frequency_penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
