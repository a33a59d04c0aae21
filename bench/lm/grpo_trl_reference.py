"""The reference side of bench/lm/grpo_vs_trl.py: TRL's GRPOTrainer on the example's GRPO job.

Run by grpo_vs_trl.py as ``python -m bench.lm.grpo_trl_reference`` in ``bench/.venv-trl`` (TRL
is never a project dependency), with the repository root on PYTHONPATH, so it reads the same
prompts (``common.datasets``), scores with the job's reward functions (resolved by name as the
reward service does: built-ins, installed plugins, references; called in process with every
dataset column, as TRL passes them) and evaluates with the learner's own
``learner.lm.evaluate.generate_greedy`` on the learner's held-out prompts, scored by the
learner's evaluation reward, at update 0 and every ``--eval-every`` updates; the evaluation's
time counts, as it does in rlfleet's learner.
Training stops at the first update that ends past ``--budget-s`` seconds after ``--started``
(the time.time() at which grpo_vs_trl.py started this process).

Writes ``<out>/eval.jsonl`` (``time_s`` since the start, ``update``, ``accuracy``, ``eval_s``)
and ``<out>/log.jsonl`` (the trainer's per-update logs with ``time_s``).

Not run by hand; see grpo_vs_trl.py.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import time
import warnings
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="the job as JSON (grpo_vs_trl)")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--started", type=float, required=True)
    parser.add_argument("--eval-every", type=int, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    job = json.loads(args.job.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    train(job, args)


def train(job: dict[str, Any], args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.datasets import iter_tasks, take
    from learner.lm.evaluate import generate_greedy
    from reward_service.rewards.catalog import load_registry
    from reward_service.rewards.registry import is_reference

    group, prompts_per_update = job["group_size"], job["groups_per_update"]
    updates = job["max_updates"]
    tasks = take(iter_tasks(job["dataset"], split="train"), updates * prompts_per_update)
    train_set = Dataset.from_list([{"prompt": t.prompt, **t.columns()} for t in tasks])
    eval_tasks = take(iter_tasks(job["eval_dataset"], split=job["eval_split"]), job["eval_count"])
    names = [*(spec["name"] for spec in job["rewards"]), job["eval_reward"]]
    registry = load_registry(references=[n for n in dict.fromkeys(names) if is_reference(n)])
    rewards = [_reward(registry[spec["name"]], spec.get("kwargs") or {}) for spec in job["rewards"]]
    weights = [spec["weight"] for spec in job["rewards"]]
    eval_reward = _reward(registry[job["eval_reward"]], {})
    eval_columns = {
        "prompts": [t.prompt for t in eval_tasks],
        **{k: [t.columns().get(k) for t in eval_tasks] for k in _keys(eval_tasks)},
    }

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=job["seed"],
        max_steps=updates,
        # One update: groups_per_update prompts x group_size completions, one optimizer step
        # over all of them (the job's minibatch_size is the whole batch), one pass.
        per_device_train_batch_size=prompts_per_update * group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=job["epochs"],
        num_generations=group,
        max_completion_length=job["max_tokens"],
        temperature=job["temperature"],
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,  # the job's prompt order
        learning_rate=job["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_epsilon=1e-8,  # the learner's AdamW
        weight_decay=0.0,
        max_grad_norm=1.0,
        # The grpo preset: PPO clip 0.2, KL 0.04 (k3) to the frozen start, group-std-normalised
        # advantages, per-sequence token mean then mean over sequences.
        beta=0.04,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="grpo",
        reward_weights=weights,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class Clock(TrainerCallback):
        """Held-out accuracy at update 0 and every eval_every updates; the stop at the budget."""

        def __init__(self) -> None:
            self.evals = (args.out / "eval.jsonl").open("w")
            self.logs = (args.out / "log.jsonl").open("w")

        def evaluate(self, model: Any, update: int) -> None:
            began = time.perf_counter()
            texts = generate_greedy(
                model, tokenizer, eval_tasks, max_tokens=job["max_tokens"], batch_size=64
            )
            scores = eval_reward(texts, **eval_columns)
            record = {
                "time_s": time.time() - args.started,
                "update": update,
                "accuracy": sum(s or 0.0 for s in scores) / len(scores),
                "eval_s": time.perf_counter() - began,
            }
            self.evals.write(json.dumps(record) + "\n")
            self.evals.flush()
            print(f"update {update}: eval accuracy {record['accuracy']:.3f}", flush=True)

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

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()


# Keywords TRL passes that rlfleet's reward service does not.
TRL_ONLY = frozenset({"trainer_state", "log_extra", "log_metric"})


def _reward(record: Any, kwargs: dict[str, Any]) -> Any:
    """A TRL reward function (completions plus the dataset's columns as keywords) around a
    reward service record, called as the service calls it, with the job's kwargs."""

    def reward(completions: list[str], **columns: Any) -> list[float | None]:
        passed = {k: v for k, v in columns.items() if k not in TRL_ONLY}
        out = record.fn(completions, **record.call_kwargs({**passed, **kwargs}))
        return asyncio.run(out) if inspect.iscoroutine(out) else out

    reward.__name__ = record.name
    return reward


def _keys(tasks: list[Any]) -> list[str]:
    return sorted({key for task in tasks for key in task.columns()})


if __name__ == "__main__":
    main()
