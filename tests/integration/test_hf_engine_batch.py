"""The transformers engine generates a request's prompts as one left-padded batch: each prompt's
completions are what it gets alone (greedy: the same tokens, log-probs to float noise), its own
token limit holds, and sampled completions stay with their prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.lm.model import token_logprobs
from sampler.engines.base import EngineConfig, SamplingOptions
from sampler.engines.hf_engine import HfEngine, create

PROMPTS = ["Q: 1+2=?\nA:", "Q: 12+34=?\nA:", "Q: 7-3=?\nA: <answer>"]


@pytest.fixture(scope="module")
async def engine(tiny_model_dir: Path) -> HfEngine:
    return await create(EngineConfig(model_path=str(tiny_model_dir)))


def _ids(engine: HfEngine) -> list[list[int]]:
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) > 1  # the batch needs padding
    return ids


async def test_a_batch_of_prompts_decodes_as_each_prompt_alone(engine: HfEngine) -> None:
    prompts = _ids(engine)
    greedy = SamplingOptions(max_tokens=[10] * len(prompts), temperature=0, logprobs=True)
    together = await engine.generate(prompts, greedy)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = await engine.generate([prompt], SamplingOptions(
            max_tokens=[10], temperature=0, logprobs=True))  # fmt: skip
        assert batched[0].token_ids == alone[0].token_ids
        assert batched[0].finish_reason == alone[0].finish_reason
        assert batched[0].logprobs == pytest.approx(alone[0].logprobs, abs=1e-4)


async def test_each_prompt_keeps_its_token_limit_and_its_own_completions(
    engine: HfEngine,
) -> None:
    prompts = _ids(engine)
    limits = [3, 8, 3]
    sampled = SamplingOptions(max_tokens=limits, n=4, temperature=1.0, logprobs=True,
                              ignore_eos=True, seed=0)  # fmt: skip
    out = await engine.generate(prompts, sampled)
    assert [len(c) for c in out] == [4, 4, 4]
    for completions, limit in zip(out, limits, strict=True):
        for c in completions:
            assert len(c.token_ids) == limit and c.finish_reason == "length"
            assert c.logprobs is not None and len(c.logprobs) == limit
            assert all(lp <= 0 for lp in c.logprobs)
    # Each completion's log-probs are those of its own prompt's continuation (a row mixed up
    # with another prompt's would score differently): teacher-forced through the model.
    for prompt, completions in zip(prompts, out, strict=True):
        for c in completions:
            assert c.logprobs == pytest.approx(_score(engine, prompt, c.token_ids), abs=1e-4)


def _score(engine: HfEngine, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(tokens | prompt) token by token at temperature 1, from one forward pass."""
    seq = torch.tensor([prompt + tokens])  # [1, P + T]
    with torch.no_grad():
        logits = engine.model(input_ids=seq).logits[:, len(prompt) - 1 : -1]  # [1, T, V]
    return token_logprobs(logits, seq[:, len(prompt) :])[0].tolist()
