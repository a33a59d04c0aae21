"""Multi-turn RL with a tool through the fleet against TRL's GRPOTrainer with an environment:
held-out accuracy against wall time from process start, on the same model, task and GRPO
hyperparameters.

The task is examples/agent_calculator.yaml's: Calculator-v0 (3-digit arithmetic with a product,
answered by calling a `calculator` tool in the chat template's format). Both sides start from one
shared post-SFT model: the job's ``init-model`` made for the env (its episodes train the
tokenizer), warm-started on the env's expert demonstrations as the job's learner does it
(``EnvEpisodes.demonstrations`` on an env server, ``learner.lm.sft.sft_phase`` on a DeepSpeed
engine with the learner's settings: the example's own post-SFT model), saved once under
``runs/bench/agent_vs_trl/``. Then, one after the other, each for ``--minutes`` of wall time
from its process start:

- rlfleet: ``rlfleet up`` on the run file with that model, ``sft_steps: 0`` and an unbounded
  ``total_updates``: NATS, the env server, the vLLM sampler, the rollout driver (episodes played
  turn by turn, token in, token out) and the DeepSpeed learner; stopped with SIGINT at the
  budget. Accuracy: the learner's ``eval/accuracy`` records in the run's metrics.jsonl.
- TRL: bench/lm/agent_trl_reference.py in ``bench/.venv-trl`` (TRL from
  bench/lm/requirements-trl.txt, layered over the project's venv): ``GRPOTrainer`` with
  ``environment_factory`` (the calculator as the environment's tool, the same schema and result
  format as Calculator-v0's), the env's openings of the same train seeds as its dataset, the
  env's answer check as the reward, TRL's own generation and tool loop, the same group size,
  episodes per update, learning rate, clip and KL (the ``grpo`` preset).

Both evaluate with the learner's own evaluator (``EnvEpisodes.evaluate``: greedy episodes of the
env's eval split on an env server, the same seeds) at update 0 and every ``--eval-every``
updates, the evaluation's time included in their clocks. ``accuracy_ratio_at_5_10_15_min`` is
rlfleet / TRL at a third, two thirds and all of the budget; the issue's target is >= 1.0 at each.

    python -m bench.lm.agent_vs_trl                 # 2 x 15 minutes, plus the SFT model once
    python -m bench.lm.agent_vs_trl --minutes 2     # smoke check

Prints the accuracy table and writes bench/results/agent_vs_trl.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from bench._shared.lm import service_process, stop_process
from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR
from bench.lm.grpo_vs_trl import (
    add_arguments,
    compare,
    learner_sft,
    load_job,
    run_reference,
    run_rlfleet,
)

RESULTS = RESULTS_DIR / "agent_vs_trl.json"
BENCH_DIR = WORK_DIR / "agent_vs_trl"
TRL_DIAGNOSTICS = {
    "reward": "reward", "entropy": "entropy", "kl": "kl",
    "clip_fraction": "clip_ratio/region_mean", "zero_std_groups": "frac_reward_zero_std",
    "completion_len": "completions/mean_length", "update_s": "step_time",
}  # fmt: skip


def env_spec(settings: Any) -> dict[str, Any]:
    """What the reference side needs of the job's env (as the learner's LearnerTextEnv)."""
    env = settings.env
    return {"env_id": env.env_id, "kwargs": env.kwargs, "max_turns": env.max_turns,
            "max_total_tokens": env.max_total_tokens}  # fmt: skip


def post_sft_model(settings: Any) -> Path:
    """The shared starting point: the job's init-model for its env, warm-started on the env's
    expert demonstrations as the learner's SFT phase does (made once)."""
    name = f"{settings.init_model}-seed{settings.seed}-sft{settings.sft_steps}"
    out = BENCH_DIR / "models" / name
    if (out / "model.safetensors").is_file():
        return out
    from learner.lm.env_episodes import EnvEpisodes
    from learner.lm.jobs import create_model
    from learner.lm.model import load_tokenizer
    from learner.lm.settings import LearnerTextEnv

    env = env_spec(settings)
    base = BENCH_DIR / "models" / f"{settings.init_model}-seed{settings.seed}"
    if not (base / "config.json").is_file():
        create_model(base, settings.init_model, dataset=settings.dataset, seed=settings.seed,
                     env={"env_id": env["env_id"], "kwargs": env["kwargs"]})  # fmt: skip
    server, address = service_process("env_server", BENCH_DIR / "sft", "env-sft")
    try:
        tokenizer = load_tokenizer(base)
        episodes = EnvEpisodes(LearnerTextEnv(env_server=address, **env), address, tokenizer)
        count = settings.sft_steps * settings.sft_batch_size
        demos = asyncio.run(episodes.demonstrations(count, settings.seed))
    finally:
        stop_process(server)
    return learner_sft(settings, base, iter(demos), out)


def run_trl(settings: Any, model: Path, budget_s: float, eval_every: int) -> dict:
    """bench/lm/agent_trl_reference.py in the TRL venv for ``budget_s`` from its start."""
    s = settings
    reference_job = {
        "env": env_spec(s), "group_size": s.group_size, "groups_per_update": s.groups_per_update,
        "max_tokens": s.max_tokens, "temperature": s.temperature,
        "learning_rate": s.learning_rate, "epochs": s.epochs, "seed": s.seed,
        "eval_count": s.eval_count,
        "max_updates": int(budget_s / 0.2) + 10,  # a bound: the budget stops it first
    }  # fmt: skip
    return run_reference(
        "bench.lm.agent_trl_reference", BENCH_DIR / "trl", reference_job, model, budget_s,
        eval_every, TRL_DIAGNOSTICS, {"TRL_EXPERIMENTAL_SILENCE": "1"},
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, ROOT / "examples" / "agent_calculator.yaml", "env.max_turns=2")
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="steps of the shared SFT warm start (default: the run file's)",
    )
    parser.set_defaults(out=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    job, settings = load_job(args.config)
    if args.sft_steps is not None:
        settings = settings.model_copy(update={"sft_steps": args.sft_steps})
    if settings.env is None:
        sys.exit(f"{args.config}: not an env job (no env:); bench.lm.grpo_vs_trl is single-turn")
    compare(
        args,
        job,
        post_sft_model(settings),
        rlfleet=lambda model, budget_s: run_rlfleet(
            job,
            model,
            budget_s,
            args.eval_every,
            run_dir=BENCH_DIR / "rlfleet",
            run_name="agent-vs-trl",
        ),
        trl=lambda model, budget_s: run_trl(settings, model, budget_s, args.eval_every),
    )


if __name__ == "__main__":
    main()
