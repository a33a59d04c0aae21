"""Held-out evaluation: greedy completions from the learner's current weights, scored by the
reward service. Greedy decoding of the same fp32 weights gives the same tokens in vLLM and
transformers (tests/integration/test_sampler_weights.py), so this measures what samplers serve.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from common.datasets import Task

__all__ = ["generate_greedy", "score_accuracy"]


@torch.no_grad()
def generate_greedy(
    model: Any, tokenizer: Any, tasks: Sequence[Task], *, max_tokens: int, batch_size: int
) -> list[str]:
    """Greedy completions (text, special tokens skipped) for ``tasks``, batched, left-padded."""
    was_training = model.training
    model.eval()
    texts: list[str] = []
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(tasks), batch_size):
            chunk = tasks[start : start + batch_size]
            prompts = [t.prompt for t in chunk]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            texts.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = previous_side
        model.train(was_training)
    return texts


async def score_accuracy(
    score: Callable[[list[dict[str, Any]]], Awaitable[list[float | None]]],
    tasks: Sequence[Task],
    completions: Sequence[str],
) -> float:
    """Mean score (abstentions count as wrong) of ``completions`` under the scorer."""
    items = [
        {"prompt": t.prompt, "completion": c, "extra": t.extra}
        for t, c in zip(tasks, completions, strict=True)
    ]
    scores = await score(items)
    return sum(s or 0.0 for s in scores) / max(len(scores), 1)
