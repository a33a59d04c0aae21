"""One GRPO step, phase by phase (generate, reward, train, sync), and the same services running
together in steady state.

Processes as deployed: NATS (services.bus.EmbeddedNats), the sampler (``python -m launch.cli
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

Then the running system (``--updates``): the services as `rlfleet up` runs them, the driver and
the learner in this process as two tasks: the driver generates, scores and builds the groups of
the next batch while the learner trains on the previous one (``--lag`` batches queued ahead, so
batches are one version old, as with ``max_policy_lag: 1``), publishes and announces the new
version and goes on; the sampler reloads it in flight. Per update: seconds of each phase while
overlapped, CPU-seconds of each process (sampler with its EngineCore, reward service, this
process), and ``overlap_ratio`` = seconds per update / max(generate alone, train alone) (1.0:
the longer phase hides the other completely; the issue's target is <= 1.15); ``vs_sequential``
= the sum of the phases alone / seconds per update; ``core_bound_ratio`` = the best
overlap_ratio the cores allow (CPU-seconds per update running / cores, over the longer phase).
The learner trains with the staleness correction of its default preset (``old_logp: auto``);
its clip fraction and policy lag are
reported. ``launch_to_first_update_s``: this process's start to the end of its first update
(services started here, no SFT: `rlfleet up` adds model creation and the warm start).

The trajectories do not travel over JetStream here (the learner's consumer is not in the
step); bench/transport/env_throughput and the bus notes in docs/platform.md cover that hop.

    python -m bench.lm.grpo_step                   # tiny model, 1 warm-up + 5 steps
    python -m bench.lm.grpo_step --model-size small --steps 10 --max-tokens 64
    # the GRPO example's shape: transformers sampler, 256 completions of <= 12 tokens, 2 threads
    OMP_NUM_THREADS=2 python -m bench.lm.grpo_step --engine hf --prompts 32 --max-tokens 12 \
        --minibatch-size 256 --updates 12

The engine matters at this scale (``core_bound_ratio`` above 1 means the cores, not the
overlap, set the pace; bench/README.md has the runs).

Prints seconds and CPU-seconds per phase alone and running (medians) and writes
bench/results/grpo_step.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from bench._shared.cpu import CpuClock
from bench._shared.lm import (
    SamplerProcess,
    arith_tasks,
    first_sample_of,
    model_dir,
    model_parameters,
    reward_service_process,
    start_weight_server,
    stop_process,
    sync_breakdown,
    vllm_environment,
)
from bench._shared.results import RESULTS_DIR, WORK_DIR, machine, median, write_results

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


def pin_processes(sampler_pid: int, reward_pid: int) -> None:
    """``--pin``: the sampler (with its EngineCore) on the last core, this process (learner and
    driver) on the others, the reward service anywhere: generation and training never take
    turns on one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin needs at least 2 cores")
    sampler = psutil.Process(sampler_pid)
    for p in [sampler, *sampler.children(recursive=True)]:
        for thread in p.threads():  # every thread: vLLM's were started before this call
            os.sched_setaffinity(thread.id, cores[-1:])
    for thread in psutil.Process().threads():
        os.sched_setaffinity(thread.id, cores[:-1])
    psutil.Process(reward_pid).cpu_affinity(cores)


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

    def train(
        self, groups: list[Any], step: int, a: argparse.Namespace, version: int | None = None
    ) -> dict[str, float]:
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
            version=version,
        )


async def one_step(ctx: dict[str, Any], step: int, a: argparse.Namespace) -> dict[str, Any]:
    from clients.trajectories.prompts import prompt_task
    from learner.weights import announce
    from sampler.rollout.groups import build_groups, generate_request, score_request
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
    clock: CpuClock = ctx["clock"]
    cpu: dict[str, float] = {}

    started, cpu0 = time.perf_counter(), clock.read()
    request = generate_request(
        tasks, SamplingSettings(temperature=1.0, max_tokens=a.max_tokens), a.group_size, None
    )
    _, reply = await ctx["samplers"].generate(request)
    out["generate"] = time.perf_counter() - started
    cpu["generate"] = sum(clock.since(cpu0).values())
    completions = [c for r in reply.results for c in r.completions]
    out["completion_tokens"] = sum(c.token_ids.shape[0] for c in completions)

    started, cpu0 = time.perf_counter(), clock.read()
    experts = [None] * len(tasks)
    scored = await ctx["rewards"].score_request(
        score_request(tasks, reply.results, experts, rewards)
    )
    out["reward"] = time.perf_counter() - started
    cpu["reward"] = sum(clock.since(cpu0).values())
    out["mean_reward"] = sum(s.total for s in scored.results) / len(scored.results)

    started, cpu0 = time.perf_counter(), clock.read()
    groups = build_groups(ctx["run"], "bench", tasks, reply.results, experts, scored.results)
    metrics = await asyncio.to_thread(learner.train, groups, step, a)
    out["train"] = time.perf_counter() - started
    cpu["train"] = sum(clock.since(cpu0).values())
    out["loss"] = float(metrics.get("losses/loss", float("nan")))  # the total minimised

    started, cpu0 = time.perf_counter(), clock.read()
    named = await asyncio.to_thread(learner.weights)
    manifest = await asyncio.to_thread(ctx["store"].publish, named)
    ctx["version"] = int(manifest.version)
    published = time.perf_counter()
    announced = time.time()
    await announce(ctx["bus"], ctx["run"], manifest, ctx["learner_address"])
    first, _ = await first_sample_of(ctx["client"], ctx["probe"], int(manifest.version))
    out["sync"] = time.perf_counter() - started
    cpu["sync"] = sum(clock.since(cpu0).values())
    out["cpu_s"] = cpu
    await asyncio.sleep(0.1)  # the sampler's log lines are written
    parts = sync_breakdown(ctx["sampler"].log(), int(manifest.version), announced, first)
    parts["announce_to_sample_s"] = parts.pop("total_s")
    out["sync_parts"] = {"publish_s": published - started, **parts}
    out["step"] = sum(out[p] for p in PHASES)
    return out


async def running_system(ctx: dict[str, Any], first: int, a: argparse.Namespace) -> dict[str, Any]:
    """``a.warmup + a.updates`` updates with generation overlapping training (see the module
    docstring); medians over the last ``a.updates``."""
    from clients.trajectories.prompts import prompt_task
    from learner.weights import announce
    from sampler.rollout.groups import build_groups, generate_request, score_request
    from sampler.rollout.settings import RewardSpec, SamplingSettings

    learner: Learner = ctx["learner"]
    clock: CpuClock = ctx["clock"]
    rewards = [
        RewardSpec(name="accuracy", weight=1.0),
        RewardSpec(name="format", weight=0.1, kwargs={"tags": ["answer"]}),
    ]
    sampling = SamplingSettings(temperature=1.0, max_tokens=a.max_tokens)
    ahead: asyncio.Queue[tuple[list[Any], dict[str, float]]] = asyncio.Queue(maxsize=a.lag)
    published: asyncio.Condition = ctx["published"]
    start_version = ctx["version"]

    async def driver() -> None:
        for i, step in enumerate(range(first, first + a.warmup + a.updates + a.lag + 1)):
            # As the rollout driver's pacer: batch i waits until version i - lag is published
            # and served, so batches are at most `lag` versions old (max_policy_lag).
            needed = start_version + i - a.lag
            async with published:
                await published.wait_for(lambda needed=needed: ctx["version"] >= needed)
            while int((await ctx["samplers"].info()).policy_version) < needed:
                await asyncio.sleep(0.005)  # the sampler is loading it (tens of ms)
            tasks = [
                prompt_task(ctx["run"], "arith", 0, t)
                for t in ctx["tasks"][step * a.prompts : (step + 1) * a.prompts]
            ]
            started = time.perf_counter()
            request = generate_request(tasks, sampling, a.group_size, None)
            _, reply = await ctx["samplers"].generate(request)
            generated = time.perf_counter()
            experts = [None] * len(tasks)
            scored = await ctx["rewards"].score_request(
                score_request(tasks, reply.results, experts, rewards)
            )
            times = {"generate": generated - started, "reward": time.perf_counter() - generated}
            groups = build_groups(
                ctx["run"], "bench", tasks, reply.results, experts, scored.results
            )
            await ahead.put((groups, times))

    producing = asyncio.create_task(driver(), name="bench-driver")
    updates: list[dict[str, Any]] = []
    try:
        last_end, cpu0 = time.perf_counter(), clock.read()
        for u in range(a.warmup + a.updates):
            waited = time.perf_counter()
            if producing.done():
                producing.result()  # the driver's error, if it failed
            groups, times = await ahead.get()
            started = time.perf_counter()
            version = ctx["version"]
            sampled = [c.policy_version for g in groups for c in g.completions]
            metrics = await asyncio.to_thread(learner.train, groups, first + u, a, version)
            trained = time.perf_counter()
            named = await asyncio.to_thread(learner.weights)
            manifest = await asyncio.to_thread(ctx["store"].publish, named)
            await announce(ctx["bus"], ctx["run"], manifest, ctx["learner_address"])
            async with published:
                ctx["version"] = int(manifest.version)
                published.notify_all()
            end = time.perf_counter()
            if ctx.get("first_update_end") is None:
                ctx["first_update_end"] = time.time()
            updates.append(
                {
                    "update_s": end - last_end,
                    "wait_s": started - waited,
                    **times,
                    "train": trained - started,
                    "sync": end - trained,
                    "cpu_s": clock.since(cpu0),
                    "policy_lag": version - sum(sampled) / len(sampled),
                    "clipfrac": metrics.get("losses/clipfrac"),
                    "ratio_mean": metrics.get("losses/ratio_mean"),
                    "warmup": u < a.warmup,
                }
            )
            last_end, cpu0 = end, clock.read()
    finally:
        producing.cancel()
        await asyncio.gather(producing, return_exceptions=True)
    measured = [x for x in updates if not x["warmup"]]
    cpu = {name: median(x["cpu_s"][name] for x in measured) for name in clock.procs}
    per_update = median(x["update_s"] for x in measured)
    return {
        "seconds_per_update": per_update,
        "median_s": {p: median(x[p] for x in measured) for p in (*PHASES, "wait_s")},
        "cpu_s_per_update": {**cpu, "total": sum(cpu.values())},
        "cores_busy": sum(cpu.values()) / per_update,
        "policy_lag": median(x["policy_lag"] for x in measured),
        "clipfrac": median(x["clipfrac"] or 0.0 for x in measured),
        "samples": updates,
    }


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    from clients.reward import RewardClient
    from clients.sampler import SamplerClient, SamplerPool
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
        settings={"max_model_len": 256} if a.engine == "vllm" else {"engine": a.engine},
    )
    steps: list[dict[str, Any]] = []
    running: dict[str, Any] = {}
    try:
        startup["sampler_ready_s"] = await asyncio.to_thread(sampler.wait_ready)
        startup["sampler_engine_s"] = sampler.engine_start_s()
        if a.pin:
            pin_processes(sampler.proc.pid, reward_proc.pid)
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
                "tasks": arith_tasks((a.steps + 2 * a.warmup + a.updates + a.lag + 1) * a.prompts),
                "probe": probe,
                "clock": CpuClock(
                    {
                        "sampler": (sampler.proc.pid, True),
                        "reward": (reward_proc.pid, True),
                        "bench": (os.getpid(), False),  # the learner and the driver
                    }
                ),
                "version": 0,
                "published": asyncio.Condition(),
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
                if step == 0:
                    ctx["first_update_end"] = time.time()
            if a.updates:
                running = await running_system(ctx, a.warmup + a.steps, a)
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
    cpu_med = {p: median(s["cpu_s"][p] for s in measured) for p in PHASES}
    launched = psutil.Process().create_time()
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
            "updates": a.updates,
            "lag": a.lag,
            "pin": a.pin,
            "engine": a.engine,
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "startup_s": startup,
        "launch_to_first_update_s": ctx["first_update_end"] - launched,
        "median_s": med,
        "median_cpu_s": cpu_med,
        "median_share": share,
        "median_sync_parts_s": sync_parts,
        **overlap(med, running),
        "samples": steps,
    }


def overlap(alone: dict[str, float], running: dict[str, Any]) -> dict[str, Any]:
    """The running system beside the phases alone: ``overlap_ratio`` (seconds per update /
    max(generate alone, train alone)), ``vs_sequential`` (sum of the phases alone / seconds per
    update) and each phase's slowdown when overlapped."""
    if not running:
        return {}
    per_update = running["seconds_per_update"]
    longest = max(alone["generate"], alone["train"])
    # The cores' limit: the CPU-seconds an update costs while running, spread over every core,
    # is the least time it can take; as a ratio, the best overlap_ratio this machine allows.
    floor_s = running["cpu_s_per_update"]["total"] / (os.cpu_count() or 1)
    return {
        "running": running,
        "seconds_per_update": per_update,
        "overlap_ratio": per_update / longest,
        "core_bound_ratio": max(floor_s, longest) / longest,
        "vs_sequential": sum(alone[p] for p in PHASES) / per_update,
        "slowdown_running": {p: running["median_s"][p] / alone[p] for p in PHASES},
    }


def print_table(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"\nGRPO step, {w['model_size']} model ({w['parameters'] / 1e6:.1f}M params): "
        f"{w['prompts']} prompts x {w['group_size']} completions, <= {w['max_tokens']} tokens; "
        f"medians of {w['steps']} steps alone, {w['updates']} updates running"
    )
    run = r.get("running", {})
    header = f"{'phase':10} {'alone s':>9} {'alone cpu':>9} {'share':>7} {'running s':>10}"
    print(header)
    print("-" * len(header))
    for p in PHASES:
        running = f"{run['median_s'][p]:10.3f}" if run else f"{'-':>10}"
        print(
            f"{p:10} {r['median_s'][p]:9.3f} {r['median_cpu_s'][p]:9.3f} "
            f"{r['median_share'][p]:6.1%} {running}"
        )
    print(f"{'step':10} {r['median_s']['step']:9.3f} {sum(r['median_cpu_s'].values()):9.3f}")
    parts = r["median_sync_parts_s"]
    shown = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.0f} ms" for k, v in parts.items())
    print(f"sync: {shown}")
    if run:
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in run["cpu_s_per_update"].items())
        print(
            f"running: {r['seconds_per_update']:.3f} s per update (learner waited "
            f"{run['median_s']['wait_s']:.3f} s for a batch); CPU-s per update: {cpu} "
            f"({run['cores_busy']:.2f} cores busy); policy lag {run['policy_lag']:.2f}, "
            f"clip fraction {run['clipfrac']:.4f}"
        )
        print(
            f"overlap_ratio {r['overlap_ratio']:.2f} (per update / max(generate, train) alone; "
            f"target <= 1.15), {r['vs_sequential']:.2f}x the phases one after another; the "
            f"cores allow {r['core_bound_ratio']:.2f} at this CPU cost per update"
        )
    s = r["startup_s"]
    print(
        "start-up: "
        + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in s.items() if v is not None)
        + f"; launch to first update {r['launch_to_first_update_s']:.1f} s"
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
    parser.add_argument(
        "--updates", type=int, default=10, help="updates of the running system (0: none)"
    )
    parser.add_argument("--lag", type=int, default=1, help="batches the driver runs ahead")
    parser.add_argument(
        "--engine",
        choices=["vllm", "hf"],
        default="vllm",
        help="the sampler's engine (hf: transformers' generate, the GRPO example's)",
    )
    parser.add_argument(
        "--pin", action="store_true", help="pin the sampler to one core, the learner to the rest"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    info = machine()
    result = asyncio.run(amain(a))
    print_table(result)
    write_results(a.out, {"machine": info, **result})


if __name__ == "__main__":
    main()
