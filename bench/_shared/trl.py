"""What the TRL reference sides of the LM benchmarks share (bench/lm/*_trl_reference.py): the
GRPOConfig that mirrors the job's GRPO update, and the callback that evaluates on a schedule and
stops at the time budget. Imported in ``bench/.venv-trl`` only (TRL is never a project
dependency): callers pass TRL's classes in."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

__all__ = ["budget_clock", "grpo_config"]


def grpo_config(
    config_class: Any,
    job: dict[str, Any],
    args: argparse.Namespace,
    *,
    max_completion_length: int,
    **extra: Any,
) -> Any:
    """TRL's GRPOConfig for the job's update: groups_per_update prompts x group_size
    completions, one optimizer step over all of them (the job's minibatch is the whole batch),
    ``epochs`` passes; the grpo preset (PPO clip 0.2, KL 0.04 (k3) to the frozen start,
    group-std-normalised advantages, per-sequence token mean then mean over sequences); the
    learner's AdamW; the job's prompt order. ``extra``: TRL fields of one side only."""
    group, prompts = job["group_size"], job["groups_per_update"]
    return config_class(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=job["seed"],
        max_steps=job["max_updates"],
        per_device_train_batch_size=prompts * group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=job["epochs"],
        num_generations=group,
        max_completion_length=max_completion_length,
        temperature=job["temperature"],
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,
        learning_rate=job["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.04,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="grpo",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def budget_clock(
    callback_class: Any,
    args: argparse.Namespace,
    measure: Callable[[Any, int], dict[str, Any]],
) -> Any:
    """A TrainerCallback: ``measure(model, update)`` (``accuracy`` and more) at update 0 and every
    ``--eval-every`` updates, written to ``<out>/eval.jsonl`` with ``time_s`` since
    ``--started``, ``update`` and ``eval_s`` (the evaluation's time counts, as in the learner);
    the trainer's logs to ``<out>/log.jsonl``; training stops at the first update that ends past
    ``--budget-s``."""

    class Clock(callback_class):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self.evals = (args.out / "eval.jsonl").open("w")
            self.logs = (args.out / "log.jsonl").open("w")

        def evaluate(self, model: Any, update: int) -> None:
            began = time.perf_counter()
            measured = measure(model, update)
            record = {
                "time_s": time.time() - args.started,
                "update": update,
                **measured,
                "eval_s": time.perf_counter() - began,
            }
            self.evals.write(json.dumps(record) + "\n")
            self.evals.flush()
            print(f"update {update}: eval accuracy {measured['accuracy']:.3f}", flush=True)

        def on_train_begin(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.evaluate(kw["model"], 0)

        def on_log(self, _args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            record = {"time_s": time.time() - args.started, "update": state.global_step}
            self.logs.write(json.dumps({**record, **(logs or {})}) + "\n")
            self.logs.flush()

        def on_step_end(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % args.eval_every == 0:
                self.evaluate(kw["model"], state.global_step)
            if time.time() - args.started >= args.budget_s:
                control.should_training_stop = True

    return Clock()
