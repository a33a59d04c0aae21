"""Held-out evaluation: greedy completions from the learner's current weights, scored by the
reward service. Greedy decoding of the same fp32 weights gives the same tokens in vLLM and
transformers (tests/integration/test_sampler_weights.py), so this measures what samplers serve.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from common.datasets import Task, iter_tasks, shared_prompts, take

if TYPE_CHECKING:
    from learner.lm.settings import EvalSettings

__all__ = ["generate_greedy", "held_out_tasks", "prompt_batch", "score_accuracy"]

log = logging.getLogger(__name__)

# Most training prompts compared with the eval prompts at start-up (a generator never ends).
MAX_TRAIN_PROMPTS_CHECKED = 100_000


def held_out_tasks(cfg: EvalSettings, train_prompts: int) -> list[Task]:
    """The evaluation's tasks, after one warning when some of them are among the first
    ``train_prompts`` prompts of ``cfg.train_dataset`` (read as the rollout drivers read it)."""
    tasks = take(iter_tasks(cfg.dataset, split=cfg.split), cfg.count)
    if cfg.train_dataset is None:
        return tasks
    limit = min(train_prompts, MAX_TRAIN_PROMPTS_CHECKED)
    shared, distinct = shared_prompts(iter_tasks(cfg.train_dataset), tasks, limit=limit)
    if shared:
        log.warning(
            "eval is not held out: %d of its %d distinct prompts (%s) are among the first %d "
            "training prompts (%s); set eval_dataset to prompts not trained on",
            shared, distinct, cfg.dataset, limit, cfg.train_dataset,
        )  # fmt: skip
    return tasks


@torch.no_grad()
def generate_greedy(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    *,
    max_tokens: int,
    batch_size: int,
    processor: Any = None,
) -> list[str]:
    """Greedy completions (text, special tokens skipped) for ``tasks``, batched, left-padded.
    Chat tasks are rendered with the chat template, as samplers render them; tasks with images
    need the vision-language model's ``processor``, which expands them and makes the pixels."""
    was_training = model.training
    model.eval()
    texts: list[str] = []
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(tasks), batch_size):
            chunk = tasks[start : start + batch_size]
            enc = prompt_batch(tokenizer, processor, chunk)
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


def prompt_batch(tokenizer: Any, processor: Any, tasks: Sequence[Task]) -> Any:
    """The model inputs of ``tasks``' prompts, padded on the tokenizer's side: raw text as it
    is, chat messages through the template, images through ``processor``."""
    prompts = [
        tokenizer.apply_chat_template(list(t.messages), tokenize=False, add_generation_prompt=True)
        if t.messages
        else t.prompt
        for t in tasks
    ]
    if not any(t.images for t in tasks):
        return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    if processor is None:
        raise ValueError("tasks with images need the model's processor (a vision-language model)")
    from common.images import open_image

    images = [[open_image(data) for data in t.images] for t in tasks]
    return processor(
        text=prompts,
        images=images,
        return_tensors="pt",
        padding=True,
        padding_side=tokenizer.padding_side,
        add_special_tokens=False,
    )


async def score_accuracy(
    score: Callable[[list[dict[str, Any]]], Awaitable[list[float | None]]],
    tasks: Sequence[Task],
    completions: Sequence[str],
) -> tuple[float, list[float | None]]:
    """Mean score (abstentions count as wrong) of ``completions`` under the scorer, and each
    completion's score."""
    items = [
        {"prompt": t.text(), "completion": c, "extra": t.columns()}  # as the rollout's
        for t, c in zip(tasks, completions, strict=True)
    ]
    scores = await score(items)
    return sum(s or 0.0 for s in scores) / max(len(scores), 1), list(scores)
