"""One GRPO step, phase by phase: generate, reward, train, sync.

Processes as deployed: NATS (services.bus.EmbeddedNats), the sampler (``python -m services.cli
serve sampler``, vLLM, following the run's weights), the reward service (``serve
reward_service``); the learner runs in this process (DeepSpeed engine, WeightStore +
WeightService on a GrpcServer, announcements on the bus). One step, with the rollout driver's
own request/group builders (sampler/rollout/groups.py) and the learner's decoding and update:

- generate: one Generate call, 8 arith prompts x 8 completions (temperature 1, up to
  ``--max-tokens`` tokens, logprobs);
- reward: one RewardService.Score over the 64 completions, accuracy (weight 1) + format
  (weight 0.1, <answer> tags);
- train: TrajectoryGroups built and decoded as the learner does, then learner.lm.update.lm_update
  on a DeepSpeed engine with the ``grpo`` preset (KL 0.04 against a frozen reference, so the
  reference forward is included), one minibatch of 64;
- sync: hf_weights + WeightStore.publish + announce, then Generate (1 prompt, 1 token) until a
  completion carries the new version; split into publish (learner side), fetch + load (announce
  -> the sampler's "serving weights vK" log line) and first sample.

The trajectories do not travel over JetStream here (the learner's consumer is not in the
step); bench/env_throughput and the bus notes in docs/platform.md cover that hop.

    python bench/grpo_step.py                          # tiny model, 1 warm-up + 5 steps
    python bench/grpo_step.py --model-size small --steps 10 --max-tokens 64

Prints seconds per phase and share of the step (medians) and writes bench/results/grpo_step.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lm_common import (
    RESULTS_DIR,
    WORK_DIR,
    SamplerProcess,
    arith_tasks,
    first_sample_of,
    machine,
    median,
    model_dir,
    model_parameters,
    reward_service_process,
    start_weight_server,
    stop_process,
    sync_breakdown,
    vllm_environment,
    write_results,
)

RESULTS = RESULTS_DIR / "grpo_step.json"
PHASES = ("generate", "reward", "train", "sync")
SYNC_PARTS = (
    "publish_s",
    "fetch_s",
    "gate_wait_s",
    "load_s",
    "vllm_reload_s",
    "first_sample_s",
    "announce_to_sample_s",
)


class Learner:
    """The learner's parts this step needs: policy engine, reference, tokenizer, preset."""

    def __init__(self, model: Path, a: argparse.Namespace) -> None:
        from learner.algos.presets import resolve_preset
        from learner.engine import build_engine
        from learner.lm.model import load_causal_lm, load_tokenizer
        from learner.settings import DeepSpeedSettings, OptimizerSettings

        started = time.perf_counter()
        self.tokenizer = load_tokenizer(model)
        policy = load_causal_lm(model)
        ds = DeepSpeedSettings(device="cpu", train_micro_batch_size=a.minibatch_size)
        self.engine = build_engine(policy, OptimizerSettings(lr=a.lr, eps=1e-8), ds)
        self.preset = resolve_preset("grpo")
        self.reference = load_causal_lm(model, frozen=True) if self.preset.kl_beta > 0 else None
        self.vocab = self.engine.module.get_input_embeddings().num_embeddings
        self.start_s = time.perf_counter() - started

    def weights(self) -> dict[str, Any]:
        from learner.lm.model import hf_weights

        return hf_weights(self.engine.module)

    def train(self, groups: list[Any], step: int, a: argparse.Namespace) -> dict[str, float]:
        from learner.lm.batch import decode_group
        from learner.lm.update import group_filter, lm_update

        samples = []
        for group in groups:
            kept, _ = group_filter(decode_group(group, self.vocab), self.preset)
            samples.extend(kept)
        return lm_update(
            self.engine,
            self.reference,
            samples,
            self.preset,
            pad_id=self.tokenizer.pad_token_id,
            lr=a.lr,
            step=step,
            minibatch_size=a.minibatch_size,
        )


async def one_step(ctx: dict[str, Any], step: int, a: argparse.Namespace) -> dict[str, Any]:
    from learner.weights import announce
    from sampler.rollout.groups import build_groups, generate_request, score_request
    from sampler.rollout.prompts import prompt_task
    from sampler.rollout.settings import RewardSpec, SamplingSettings

    learner: Learner = ctx["learner"]
    tasks = [
        prompt_task(ctx["run"], "arith", 0, t)
        for t in ctx["tasks"][step * a.prompts : (step + 1) * a.prompts]
    ]
    rewards = [
        RewardSpec(name="accuracy", weight=1.0),
        RewardSpec(name="format", weight=0.1, kwargs={"tags": ["answer"]}),
    ]
    out: dict[str, Any] = {}

    started = time.perf_counter()
    request = generate_request(
        tasks, SamplingSettings(temperature=1.0, max_tokens=a.max_tokens), a.group_size, None
    )
    _, reply = await ctx["samplers"].generate(request)
    out["generate"] = time.perf_counter() - started
    completions = [c for r in reply.results for c in r.completions]
    out["completion_tokens"] = sum(c.token_ids.shape[0] for c in completions)

    started = time.perf_counter()
    experts = [None] * len(tasks)
    scored = await ctx["rewards"].score_request(
        score_request(tasks, reply.results, experts, rewards)
    )
    out["reward"] = time.perf_counter() - started
    out["mean_reward"] = sum(s.total for s in scored.results) / len(scored.results)

    started = time.perf_counter()
    groups = build_groups(ctx["run"], "bench", tasks, reply.results, experts, scored.results)
    metrics = await asyncio.to_thread(learner.train, groups, step, a)
    out["train"] = time.perf_counter() - started
    out["loss"] = float(metrics.get("losses/loss", float("nan")))  # the total minimised

    started = time.perf_counter()
    named = await asyncio.to_thread(learner.weights)
    manifest = await asyncio.to_thread(ctx["store"].publish, named)
    published = time.perf_counter()
    announced = time.time()
    await announce(ctx["bus"], ctx["run"], manifest, ctx["learner_address"])
    first, _ = await first_sample_of(ctx["client"], ctx["probe"], int(manifest.version))
    out["sync"] = time.perf_counter() - started
    await asyncio.sleep(0.1)  # the sampler's log lines are written
    parts = sync_breakdown(ctx["sampler"].log(), int(manifest.version), announced, first)
    parts["announce_to_sample_s"] = parts.pop("total_s")
    out["sync_parts"] = {"publish_s": published - started, **parts}
    out["step"] = sum(out[p] for p in PHASES)
    return out


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    from reward_service.client import RewardClient
    from sampler.client import SamplerClient, SamplerPool
    from services.bus import Bus, EmbeddedNats

    model = model_dir(a.model_size)
    run = f"grpo-step-{uuid.uuid4().hex[:6]}"
    run_dir = WORK_DIR / f"grpo_step-{os.getpid()}"
    vllm_environment(run_dir)
    nats = EmbeddedNats(run_dir / "nats")
    nats.start()
    started = time.perf_counter()
    reward_proc, reward_address = reward_service_process(run_dir)
    startup = {"reward_service_s": time.perf_counter() - started}
    learner = Learner(model, a)
    startup["learner_s"] = learner.start_s
    store, server = await start_weight_server(run, keep=2)
    await asyncio.to_thread(store.publish, learner.weights())  # v0, before the sampler asks
    bus = await Bus.connect(nats.url, name="bench-learner")
    sampler = SamplerProcess(
        model,
        run_dir,
        run=run,
        nats_url=nats.url,
        weights_from=server.address,
        settings={"max_model_len": 256},
    )
    steps: list[dict[str, Any]] = []
    try:
        startup["sampler_ready_s"] = await asyncio.to_thread(sampler.wait_ready)
        startup["sampler_engine_s"] = sampler.engine_start_s()
        probe = list(learner.tokenizer(arith_tasks(1, seed=1)[0].prompt)["input_ids"])
        async with SamplerClient(sampler.address) as client:
            ctx = {
                "run": run,
                "learner": learner,
                "store": store,
                "bus": bus,
                "learner_address": server.address,
                "sampler": sampler,
                "client": client,
                "samplers": SamplerPool([sampler.address], timeout_s=600),
                "rewards": RewardClient(reward_address, timeout_s=600),
                "tasks": arith_tasks((a.steps + a.warmup) * a.prompts),
                "probe": probe,
            }
            for step in range(a.warmup + a.steps):
                result = await one_step(ctx, step, a)
                result["warmup"] = step < a.warmup
                steps.append(result)
                print(
                    f"step {step}{' (warm-up)' if result['warmup'] else ''}: "
                    + ", ".join(f"{p} {result[p]:.3f} s" for p in PHASES)
                    + f"; reward {result['mean_reward']:.3f}",
                    flush=True,
                )
            await ctx["samplers"].close()
            await ctx["rewards"].close()
    finally:
        sampler.stop()
        stop_process(reward_proc)
        await bus.close()
        await server.stop()
        learner.engine.close()
        nats.stop()

    measured = [s for s in steps if not s["warmup"]]
    med = {p: median(s[p] for s in measured) for p in (*PHASES, "step")}
    share = {p: median(s[p] / s["step"] for s in measured) for p in PHASES}
    sync_parts = {
        k: median(s["sync_parts"][k] for s in measured if s["sync_parts"].get(k) is not None)
        for k in SYNC_PARTS
        if any(s["sync_parts"].get(k) is not None for s in measured)
    }
    return {
        "workload": {
            "model_size": a.model_size,
            "parameters": model_parameters(model),
            "prompts": a.prompts,
            "group_size": a.group_size,
            "max_tokens": a.max_tokens,
            "preset": "grpo",
            "minibatch_size": a.minibatch_size,
            "steps": a.steps,
            "warmup": a.warmup,
        },
        "startup_s": startup,
        "median_s": med,
        "median_share": share,
        "median_sync_parts_s": sync_parts,
        "samples": steps,
    }


def print_table(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"\nGRPO step, {w['model_size']} model ({w['parameters'] / 1e6:.1f}M params): "
        f"{w['prompts']} prompts x {w['group_size']} completions, <= {w['max_tokens']} tokens; "
        f"medians of {w['steps']} steps"
    )
    header = f"{'phase':10} {'seconds':>9} {'share':>7}"
    print(header)
    print("-" * len(header))
    for p in PHASES:
        print(f"{p:10} {r['median_s'][p]:9.3f} {r['median_share'][p]:6.1%}")
    print(f"{'step':10} {r['median_s']['step']:9.3f}")
    parts = r["median_sync_parts_s"]
    shown = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.0f} ms" for k, v in parts.items())
    print(f"sync: {shown}")
    s = r["startup_s"]
    print(
        "start-up (not in the step): "
        + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in s.items() if v is not None)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "small", "base100m"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--minibatch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    info = machine()
    result = asyncio.run(amain(a))
    print_table(result)
    write_results(a.out, {"machine": info, **result})


if __name__ == "__main__":
    main()
