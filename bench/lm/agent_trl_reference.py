"""The reference side of bench/lm/agent_vs_trl.py: TRL's GRPOTrainer with an environment.

Run by agent_vs_trl.py as ``python -m bench.lm.agent_trl_reference`` in ``bench/.venv-trl``
(TRL is never a project dependency), with the repository root on PYTHONPATH:

- dataset: the env's openings (system prompt and question) for the train-split episode seeds
  the rollout drivers draw (``common.datasets.env_seeds``), with each task's ``answer``;
- ``environment_factory``: an object whose ``calculator`` method is the tool, with Calculator-v0's
  function and result format (``run_tool(calculate, ...)`` as JSON); TRL renders its schema
  from the method's signature and docstring, parses the model's tool calls with the Hermes /
  Qwen response template (the format of the tiny model's chat template) and loops generation and
  tool calls up to ``max_turns - 1`` times;
- reward: Calculator-v0's own check of the final answer (``answer_of``);
- evaluation: the learner's ``EnvEpisodes.evaluate`` (greedy episodes of the eval split on an env
  server this process starts, the same seeds as rlfleet's learner) at update 0 and every
  ``--eval-every`` updates, its time counted.
Training stops at the first update that ends past ``--budget-s`` seconds after ``--started``.

Writes ``<out>/eval.jsonl`` and ``<out>/log.jsonl`` as bench/lm/grpo_trl_reference.py does.
Not run by hand; see agent_vs_trl.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOOL_TIMEOUT_S = 5.0  # Calculator-v0's default tool_timeout_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="the job as JSON (agent_vs_trl)")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--started", type=float, required=True)
    parser.add_argument("--eval-every", type=int, required=True)
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    from bench._shared.lm import service_process, stop_process

    server, address = service_process("env_server", args.out, "env-eval")
    try:
        train(job, args, address)
    finally:
        stop_process(server)


class CalculatorTools:
    """Calculator-v0's tool as a TRL environment (one instance per rollout)."""

    def reset(self, **_: Any) -> None:
        return None  # the dataset's prompt already asks the question

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: e.g. 123 * 456
        """
        from env_server.text.envs import calculate
        from env_server.text.tools import run_tool

        return json.dumps(run_tool(calculate, {"expression": expression}, TOOL_TIMEOUT_S),
                          sort_keys=True)  # fmt: skip


def train_rows(env: dict[str, Any], seed: int, count: int) -> list[dict[str, Any]]:
    """The openings of ``count`` train-split episodes, as rollout drivers draw their seeds."""
    from common.datasets import ENV_SEED_KEY, env_seeds
    from env_server.registry import make_text_env

    made = make_text_env(env["env_id"], kwargs={**env["kwargs"], "split": "train"})
    rows = []
    for task in env_seeds(env_id=env["env_id"], seed=seed, split="train", count=count):
        messages, info = made.reset(seed=int(task.extra[ENV_SEED_KEY]))
        rows.append({"prompt": messages, "answer": info["answer"]})
    return rows


def answer_reward(completions: list[Any], answer: list[int], **_: Any) -> list[float]:
    """1 when the last assistant message's answer is right (Calculator-v0's rule)."""
    from env_server.text.envs import answer_of

    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        said = [m for m in completion if m.get("role") == "assistant"]
        text = (said[-1].get("content") or "") if said else ""
        scores.append(1.0 if answer_of(text) == expected else 0.0)
    return scores


def fleet_tools(apply: Callable[..., Any]) -> Callable[..., Any]:
    """A tokenizer's ``apply_chat_template`` that renders tools as the fleet renders the env's:
    the schema TRL derives from a method, less the return type the env's schema does not state,
    keys sorted (``canonical_tools``). So TRL's prompts are the env's, the ones the post-SFT
    model was warm-started on (TRL's own key order made the model stop after ``<tool_call>``)."""
    from transformers.utils import get_json_schema

    from common.models import canonical_tools

    def render(*args: Any, tools: list[Any] | None = None, **kwargs: Any) -> Any:
        if tools:
            schemas = [get_json_schema(t) if callable(t) else dict(t) for t in tools]
            for schema in schemas:
                schema.get("function", {}).pop("return", None)
            tools = canonical_tools(schemas)
        return apply(*args, tools=tools, **kwargs)

    return render


def train(job: dict[str, Any], args: argparse.Namespace, env_address: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from bench._shared.trl import budget_clock, grpo_config
    from clients.env.episodes import ChatTokens
    from learner.lm.env_episodes import EnvEpisodes
    from learner.lm.settings import LearnerTextEnv

    env = job["env"]
    prompts_per_update = job["groups_per_update"]
    updates = job["max_updates"]
    train_set = Dataset.from_list(train_rows(env, job["seed"], updates * prompts_per_update))
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    # The tiny model's template writes tool calls as Qwen does: <tool_call>{json}</tool_call>.
    tokenizer.response_template = qwen3_template
    tokenizer.apply_chat_template = fleet_tools(tokenizer.apply_chat_template)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    # TRL takes the tokenizer's EOS for the end of a model turn (it stops the turn there and
    # splices tool results in after it), as chat models' tokenizers declare it; the tiny model's
    # declares <|endoftext|> while its template ends turns with <|im_end|>: without this, TRL
    # generated every turn to its length cap, then lost the newline after each turn.
    (turn_end,) = ChatTokens(tokenizer).turn_end
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(turn_end)
    # The evaluator gets the tokenizer as saved, as rlfleet's learner does.
    saved = AutoTokenizer.from_pretrained(str(args.model))
    episodes = EnvEpisodes(LearnerTextEnv(env_server=env_address, **env), env_address, saved)
    from env_server.registry import make_text_env

    tools = make_text_env(env["env_id"], kwargs=env["kwargs"]).tools
    opening = max(
        len(tokenizer(text, add_special_tokens=False)["input_ids"])
        for text in (
            tokenizer.apply_chat_template(
                row["prompt"], tools=tools, add_generation_prompt=True, tokenize=False
            )
            for row in train_set.select(range(min(64, len(train_set))))
        )
    )
    # The episode's token budget after its opening (rlfleet caps each turn at max_tokens and the
    # whole episode at max_total_tokens; TRL caps the completion as a whole).
    config = grpo_config(
        GRPOConfig,
        job,
        args,
        max_completion_length=env["max_total_tokens"] - opening,
        max_tool_calling_iterations=env["max_turns"] - 1,
    )

    def measure(model: Any, update: int) -> dict[str, Any]:
        model.eval()
        accuracy, outcomes, _ = asyncio.run(
            episodes.evaluate(model, job["eval_count"], job["seed"], update)
        )
        model.train()
        return {"accuracy": accuracy, **outcomes}

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[answer_reward],
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        environment_factory=CalculatorTools,
        callbacks=[budget_clock(TrainerCallback, args, measure)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
