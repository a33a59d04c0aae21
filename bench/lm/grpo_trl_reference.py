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

    from bench._shared.trl import budget_clock, grpo_config
    from common.datasets import iter_tasks, take
    from learner.lm.evaluate import generate_greedy
    from reward_service.rewards.catalog import load_registry
    from reward_service.rewards.registry import is_reference

    prompts_per_update = job["groups_per_update"]
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
    config = grpo_config(
        GRPOConfig, job, args, max_completion_length=job["max_tokens"], reward_weights=weights
    )

    def measure(model: Any, update: int) -> dict[str, Any]:
        texts = generate_greedy(
            model, tokenizer, eval_tasks, max_tokens=job["max_tokens"], batch_size=64
        )
        scores = eval_reward(texts, **eval_columns)
        return {"accuracy": sum(s or 0.0 for s in scores) / len(scores)}

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[budget_clock(TrainerCallback, args, measure)],
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
