"""Multi-turn rollouts on vLLM samplers: episodes/s, model tokens/s and the prefix-cache hit rate
with 1 and 2 sampler replicas, every turn of a group on the replica of its first turn (sticky,
as rollout drivers play them) against each turn on a replica drawn at random.

The rollout driver's own loop (clients.env.episodes.play_group with sampler/rollout/turns.py's
model turns): GuessNumber-v0 on an env server process, groups of ``--group-size`` episodes of one
task, ``--concurrency`` groups in flight, each turn's whole conversation sent as a pre-tokenized
prompt. Sides, each over the same ``--groups`` tasks, in rotating order for ``--repeats`` rounds:
    1 replica          every group on sampler 0
    2 replicas sticky  a group on the least-busy replica when it starts, all its turns there
    2 replicas random  each turn of each episode on a replica drawn at random
The hit rate is the samplers' own count (PromptResult.cached_prompt_tokens, vLLM's
num_cached_tokens) over the prompt tokens sent: every turn resends the conversation so far, which
the replica that served the turn before holds in its prefix cache.

    .venv/bin/python -m bench.lm.agent_rollout
    .venv/bin/python -m bench.lm.agent_rollout --groups 24 --repeats 3

Writes bench/results/agent_rollout.json: ``sticky_prefix_hit_rate`` (2 replicas sticky; target
>= 0.8), ``random_prefix_hit_rate``, and per side episodes/s, tokens/s and the hit rate (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from typing import Any

from bench._shared.lm import SamplerProcess, model_dir, model_parameters, service_process
from bench._shared.results import RESULTS_DIR, WORK_DIR, machine, median, write_results

RESULTS = RESULTS_DIR / "agent_rollout.json"
ENV_ID = "GuessNumber-v0"
TARGET_HIT_RATE = 0.8
SIDES = ("1 replica", "2 replicas sticky", "2 replicas random")


class Counted:
    """A side's model turns: which sampler each goes to, and what the samplers said of them."""

    def __init__(self, clients: list[Any], sampling: Any, *, sticky: bool, seed: int) -> None:
        from sampler.rollout.turns import sampler_turns

        self.turns = [sampler_turns(client, sampling) for client in clients]
        self.sticky = sticky
        self.rng = random.Random(seed)
        self.busy = [0] * len(clients)  # groups in flight per replica (sticky: least busy)

    def group(self) -> tuple[int, Any]:
        """A replica for a new group and its Generate (sticky: that replica; else random)."""
        replica = min(range(len(self.busy)), key=self.busy.__getitem__)
        self.busy[replica] += 1
        if self.sticky:
            return replica, self.turns[replica]

        async def anywhere(episode: Any, prompt_ids: list[int], room: int) -> Any:
            return await self.rng.choice(self.turns)(episode, prompt_ids, room)

        return replica, anywhere


async def one_round(
    address: str, counted: Counted, tokenizer: Any, seeds: list[int], a: argparse.Namespace
) -> dict[str, Any]:
    """Play a group per seed, ``a.concurrency`` at once; totals and rates."""
    from clients.env.episodes import ChatTokens, EpisodeLimits, play_group
    from clients.env.text import TextSession

    limits = EpisodeLimits(max_turns=a.max_turns, max_total_tokens=a.max_total_tokens)
    queue = list(seeds)
    totals = {"episodes": 0, "tokens": 0, "prompt_tokens": 0, "cached_tokens": 0, "turns": 0}

    async def worker() -> None:
        async with TextSession(address) as session:
            info = await session.create(ENV_ID, a.group_size, kwargs={"max_range": a.max_range})
            tokens = ChatTokens(tokenizer, info.tools)
            while queue:
                seed = queue.pop()
                replica, generate = counted.group()
                try:
                    episodes = await play_group(
                        session, seed, a.group_size, tokens, generate, limits
                    )
                finally:
                    counted.busy[replica] -= 1
                for e in episodes:
                    totals["episodes"] += 1
                    totals["tokens"] += sum(e.loss_mask)
                    totals["prompt_tokens"] += e.prompt_tokens
                    totals["cached_tokens"] += e.cached_tokens
                    totals["turns"] += e.turns

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    seconds = time.perf_counter() - started
    return {
        **totals,
        "seconds": seconds,
        "episodes_per_s": totals["episodes"] / seconds,
        "tokens_per_s": totals["tokens"] / seconds,
        "prefix_hit_rate": totals["cached_tokens"] / max(totals["prompt_tokens"], 1),
    }


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from clients.sampler import SamplerClient
    from common.datasets import ENV_SEED_KEY, env_seeds
    from rlfleet.sampler.v1 import sampler_pb2

    model = model_dir(a.model_size)
    run_dir = WORK_DIR / f"agent_rollout-{os.getpid()}"
    tokenizer = AutoTokenizer.from_pretrained(model)
    seeds = [int(t.extra[ENV_SEED_KEY]) for t in env_seeds(env_id=ENV_ID, count=a.groups)]
    sampling = sampler_pb2.SamplingParams(temperature=1.0, max_tokens=a.max_tokens)
    env_proc, env_address = service_process("env_server", run_dir, "env-0")
    settings = {"max_model_len": a.max_total_tokens, "kv_cache_gib": 1, "block_size": a.block_size}
    procs = [
        SamplerProcess(model, run_dir / f"s{i}", name=f"sampler-{i}", settings=settings,
                       omp_threads=1)
        for i in range(2)
    ]  # fmt: skip
    clients: list[Any] = []
    try:
        startup = [proc.wait_ready() for proc in procs]
        clients = [SamplerClient(proc.address) for proc in procs]
        sides = {
            "1 replica": lambda r: Counted(clients[:1], sampling, sticky=True, seed=r),
            "2 replicas sticky": lambda r: Counted(clients, sampling, sticky=True, seed=r),
            "2 replicas random": lambda r: Counted(clients, sampling, sticky=False, seed=r),
        }
        # Warm-up: each replica's first requests are slow, and its cache starts empty.
        await one_round(env_address, sides["2 replicas random"](0), tokenizer, seeds[:4], a)
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
        for round_ in range(a.repeats):
            order = SIDES[round_ % 3 :] + SIDES[: round_ % 3]
            for name in order:
                got = await one_round(env_address, sides[name](round_), tokenizer, seeds, a)
                samples[name].append(got)
                print(
                    f"round {round_ + 1}/{a.repeats} {name}: {got['episodes_per_s']:.2f} "
                    f"episodes/s, {got['tokens_per_s']:.0f} tokens/s, prefix hit rate "
                    f"{got['prefix_hit_rate']:.3f}",
                    flush=True,
                )
    finally:
        for client in clients:
            await client.close()
        for proc in procs:
            proc.stop()
        env_proc.terminate()
        env_proc.wait(timeout=30)
    med = {
        name: {
            key: median(run[key] for run in runs)
            for key in ("episodes_per_s", "tokens_per_s", "prefix_hit_rate", "seconds")
        }
        for name, runs in samples.items()
    }
    sticky = med["2 replicas sticky"]["prefix_hit_rate"]
    return {
        "sticky_prefix_hit_rate": sticky,
        "random_prefix_hit_rate": med["2 replicas random"]["prefix_hit_rate"],
        "one_replica_prefix_hit_rate": med["1 replica"]["prefix_hit_rate"],
        "target_hit_rate": TARGET_HIT_RATE,
        "target_met": sticky >= TARGET_HIT_RATE,
        "two_vs_one_episodes_per_s": med["2 replicas sticky"]["episodes_per_s"]
        / med["1 replica"]["episodes_per_s"],
        "median": med,
        "samples": samples,
        "startup_s": startup,
        "workload": {
            "env_id": ENV_ID,
            "max_range": a.max_range,
            "groups": a.groups,
            "group_size": a.group_size,
            "concurrency": a.concurrency,
            "max_turns": a.max_turns,
            "max_tokens": a.max_tokens,
            "max_total_tokens": a.max_total_tokens,
            "repeats": a.repeats,
            "model_size": a.model_size,
            "parameters": model_parameters(model),
            "engine": "vllm",
            "block_size": a.block_size,
        },
        "machine": machine(),
    }


def main() -> None:
    from learner.lm.jobs import ENV_BLOCK_SIZE  # as an env job's samplers run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16, help="tasks (groups) per round")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="groups in flight")
    parser.add_argument("--max-turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8, help="per model turn")
    parser.add_argument("--max-total-tokens", type=int, default=512)
    parser.add_argument("--max-range", type=int, default=16, help="GuessNumber's range")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument(
        "--block-size", type=int, default=ENV_BLOCK_SIZE, help="vLLM KV block, in tokens"
    )
    a = parser.parse_args()
    result = asyncio.run(amain(a))
    print(f"\n{'side':<20} {'episodes/s':>11} {'tokens/s':>9} {'prefix hit':>11}")
    for name, values in result["median"].items():
        print(
            f"{name:<20} {values['episodes_per_s']:>11.2f} {values['tokens_per_s']:>9.0f} "
            f"{values['prefix_hit_rate']:>11.3f}"
        )
    met = "met" if result["target_met"] else "NOT met"
    print(f"sticky_prefix_hit_rate {result['sticky_prefix_hit_rate']:.3f} (target >= "
          f"{TARGET_HIT_RATE}: {met}); random {result['random_prefix_hit_rate']:.3f}")  # fmt: skip
    write_results(RESULTS, result)


if __name__ == "__main__":
    main()
