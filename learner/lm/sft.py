"""The supervised warm start: next-token NLL on expert completions (a dataset's solutions, or a
text env's demonstrated episodes, whose loss masks keep the env's turns out). A task with images
is rendered by the vision-language model's processor and trains on its pixels.

Runs on the same DeepSpeed engine as the RL updates, before the first weight version is
published, so samplers start from the warm-started model.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from common.datasets import Task
from learner.algos import aggregate, sft_loss
from learner.lm.batch import Sample, collate
from learner.lm.model import batch_logprobs

if TYPE_CHECKING:
    from learner.engine import TrainEngine

__all__ = ["expert_sample", "expert_samples", "sft_phase"]

log = logging.getLogger(__name__)


def _prompt(
    task: Task, tokenizer: Any, processor: Any
) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:
    """The task's prompt ids as the model sees them, and its images' pixels (None: text)."""
    if not task.images:
        if task.messages:
            ids = tokenizer.apply_chat_template(list(task.messages), add_generation_prompt=True)
        else:
            ids = tokenizer(task.prompt, add_special_tokens=False)["input_ids"]
        return list(ids), None, None
    if processor is None:  # the prompt's tokens alone would train on image markers without pixels
        raise ValueError(
            f"task {task.prompt_id} has images, but the model reads text only (no vision_config)"
        )
    from common.images import open_image
    from learner.lm.model import image_pixels

    images = [open_image(data) for data in task.images]
    if task.messages:
        text = processor.apply_chat_template(list(task.messages), add_generation_prompt=True)
    else:
        text = task.prompt
    # The processor expands each image marker to the model's placeholder tokens: the prompt
    # exactly as a sampler sees it.
    ids = processor(text=[text], images=[images])["input_ids"][0]
    values, mask = image_pixels(processor, images)
    return list(ids), values, mask


def expert_sample(
    task: Task, tokenizer: Any, group_id: str = "sft", processor: Any = None
) -> Sample:
    """The task's prompt and solution (+ end of sequence) as one expert completion; a task with
    images needs the vision-language model's ``processor`` (its prompt and pixels)."""
    if task.solution is None:
        raise ValueError(f"task {task.prompt_id} has no solution to learn from")
    prompt, pixel_values, pixel_mask = _prompt(task, tokenizer, processor)
    completion = tokenizer(task.solution, add_special_tokens=False)["input_ids"]
    completion = [*completion, tokenizer.eos_token_id]
    return Sample(
        group_id=group_id,
        prompt_ids=np.asarray(prompt, dtype=np.int64),
        completion_ids=np.asarray(completion, dtype=np.int64),
        rollout_logp=None,
        loss_mask=np.ones(len(completion), dtype=bool),
        reward=None,
        truncated=False,
        expert=True,
        policy_version=0,
        scores={},
        pixel_values=pixel_values,
        pixel_attention_mask=pixel_mask,
    )


def expert_samples(
    tasks: Iterable[Task], tokenizer: Any, processor: Any = None
) -> Iterator[Sample]:
    """The tasks' solutions as expert completions, lazily (generators never end)."""
    return (expert_sample(task, tokenizer, processor=processor) for task in tasks)


def sft_phase(
    engine: TrainEngine,
    tokenizer: Any,
    examples: Iterator[Sample],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    log_every: int = 20,
    on_step: Callable[[int, float], None] | None = None,
    pack_tokens: int | None = None,
) -> list[dict[str, float]]:
    """``steps`` optimizer steps of token-mean NLL; returns the logged metrics. ``on_step``
    gets (step, loss) after every step (the console's progress); ``pack_tokens`` packs each
    forward pass (learner/lm/packing.py)."""
    engine.set_lr(learning_rate)
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        samples = list(itertools.islice(examples, batch_size))
        if not samples:
            log.info("SFT data ran out after %d steps", step - 1)
            break
        batch = collate(samples, tokenizer.pad_token_id)
        logp, _ = batch_logprobs(engine, batch, pack_tokens=pack_tokens)  # [B, L-1]
        loss = aggregate(sft_loss(logp, batch.mask), batch.mask, "token-mean")
        engine.backward(loss)
        engine.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))
        if step % log_every == 0 or step == steps:
            metrics = {"sft/loss": float(loss.detach()), "sft/step": float(step)}
            history.append(metrics)
            log.info(
                "SFT step %d/%d: loss %.4f (%.1f s)",
                step,
                steps,
                metrics["sft/loss"],
                time.perf_counter() - started,
            )
    return history
