"""Sampler replicas: generation throughput of the rollout path with 1 and with 2 sampler
processes behind one driver, the same load, in the same run.

What a GRPO job with ``num_samplers: 2`` does (learner/lm/jobs.py ``expand``): every rollout
driver gets the list of samplers, and its ``SamplerPool`` (clients/sampler.py) sends each Generate
call to the next one in turn, ``concurrency`` calls in flight (RolloutSettings.concurrency, the
driver's workers). Here, in this process: a ``SamplerPool`` over one sampler and one over two,
``--concurrency`` workers each taking the next call of a round, every request the driver's own
(sampler/rollout/groups.generate_request: prompts_per_call prompts, n = group_size, logprobs).

Workload (default, the GRPO job's defaults): 128 arith prompts per round in calls of 8 prompts,
n = 8, 16 tokens, temperature 1, tiny model; ``ignore_eos`` so every completion has 16 tokens
(the same work every round; ``--eos`` keeps the model's stopping). Two ``rlfleet serve sampler``
processes (OMP_NUM_THREADS=1 each) start concurrently; "1 replica" uses the first, "2 replicas"
both. After a warm-up call on each sampler and a warm-up round of each side, the sides alternate
(the lead rotates) for ``--repeats`` rounds at each ``--concurrency``; the table shows medians.

    .venv/bin/python -m bench.lm.sampler_replicas
    .venv/bin/python -m bench.lm.sampler_replicas --concurrency 4 --repeats 3
    .venv/bin/python -m bench.lm.sampler_replicas --bind placement  # as `rlfleet up` places them

Writes bench/results/sampler_replicas.json; ``two_vs_one_throughput`` is 2 replicas / 1 replica
tokens/s at the highest concurrency (``by_concurrency`` has each level), ``calls_per_sampler``
shows the round-robin split. On a machine with fewer than ``CORES_PER_REPLICA`` cores per engine
the two engines time-slice the cores one already uses, so no speed-up is expected there
(``scaling_measurable: false``); with cores (or GPUs) of their own the replicas add up.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._shared.lm import SamplerProcess, arith_tasks, model_dir, model_parameters
from bench._shared.results import RESULTS_DIR, WORK_DIR, machine, median, write_results

RESULTS = RESULTS_DIR / "sampler_replicas.json"
KV_CACHE_GIB = 1
MAX_NUM_SEQS = 256
# An engine busy with a batch keeps about one core for its worker and one for its front end
# (sampler process + engine core), as in bench/serving/gateway.py: below this many cores per
# replica, 2 replicas share the cores 1 replica already used.
CORES_PER_REPLICA = 2
SIDES = {"1 replica": 1, "2 replicas": 2}


@contextlib.contextmanager
def bind_environment(bind: str, index: int) -> Iterator[None]:
    """``bind="distinct"``: sampler ``index``'s vLLM worker on core ``index`` of its own
    (VLLM_CPU_OMP_THREADS_BIND); ``"auto"`` leaves vLLM's default, as a job runs it (which binds
    every engine's one worker thread to the same core here: see ``omp_core_ids``)."""
    key = "VLLM_CPU_OMP_THREADS_BIND"
    saved = os.environ.get(key)
    if bind == "distinct":
        os.environ[key] = str(index % (os.cpu_count() or 1))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def replica_placement(bind: str) -> dict[str, list[int]]:
    """``bind="placement"``: each sampler's CPUs as `rlfleet up` assigns them to two vLLM
    replicas (services/placement.py replica_cpus; the sampler binds its worker to them and
    pins itself there once serving); otherwise none."""
    from types import SimpleNamespace

    from services.placement import replica_cpus

    if bind != "placement":
        return {}
    names = [f"sampler-{i}" for i in range(2)]
    entries = [SimpleNamespace(name=name, cpus=None) for name in names]
    sets, warning = replica_cpus(entries, sorted(os.sched_getaffinity(0)), names)
    if warning:
        print(f"placement: {warning}", flush=True)
    return sets


def omp_cores(proc: SamplerProcess) -> str | None:
    """The cores vLLM bound the engine's worker threads to ('core ids=[0]' in its log)."""
    match = re.search(r"core ids=(\[[\d, ]*\])", proc.log_path.read_text(errors="replace"))
    return match[1] if match else None


def build_requests(a: argparse.Namespace) -> list[Any]:
    """The Generate requests of one round: the driver's, ``prompts_per_call`` prompts each."""
    from clients.trajectories.prompts import prompt_task
    from sampler.rollout.groups import generate_request
    from sampler.rollout.settings import SamplingSettings

    tasks = [prompt_task("bench", "arith", 0, t) for t in arith_tasks(a.prompts)]
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=a.max_tokens)
    requests = []
    for start in range(0, len(tasks), a.prompts_per_call):
        chunk = tasks[start : start + a.prompts_per_call]
        request = generate_request(chunk, sampling, a.group_size, None)
        request.sampling.ignore_eos = not a.eos
        requests.append(request)
    return requests


async def one_round(pool: Any, requests: list[Any], concurrency: int) -> dict[str, Any]:
    """All ``requests`` through ``pool`` by ``concurrency`` workers (each takes the next call, as
    the driver's workers take the next prompts); seconds, completions, tokens, calls per sampler."""
    from common import tensor

    queue = collections.deque(requests)
    calls: collections.Counter[str] = collections.Counter()
    totals = {"completions": 0, "tokens": 0}

    async def worker() -> None:
        while queue:
            request = queue.popleft()
            address, response = await pool.generate(request)
            calls[address] += 1
            for result in response.results:
                totals["completions"] += len(result.completions)
                totals["tokens"] += sum(len(tensor.decode(c.token_ids)) for c in result.completions)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        **totals,
        "completions_per_s": totals["completions"] / seconds,
        "tokens_per_s": totals["tokens"] / seconds,
        "calls": dict(calls),
    }


async def measure(
    pools: dict[str, Any], requests: list[Any], a: argparse.Namespace
) -> dict[str, Any]:
    expected = sum(len(r.prompts) for r in requests) * a.group_size
    out: dict[str, Any] = {}
    for concurrency in a.concurrency:
        warm = {name: await one_round(pool, requests, concurrency) for name, pool in pools.items()}
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in pools}
        names = list(pools)
        for round_ in range(a.repeats):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]  # rotate the lead
            for name in order:
                got = await one_round(pools[name], requests, concurrency)
                if got["completions"] != expected:
                    raise SystemExit(f"{name}: {got['completions']} completions, want {expected}")
                samples[name].append(got)
            print(
                f"concurrency {concurrency}, round {round_ + 1}/{a.repeats}: "
                + ", ".join(f"{n} {samples[n][-1]['tokens_per_s']:.0f} tok/s" for n in names),
                flush=True,
            )
        med = {
            name: {
                "tokens_per_s": median(s["tokens_per_s"] for s in runs),
                "completions_per_s": median(s["completions_per_s"] for s in runs),
                "seconds": median(s["seconds"] for s in runs),
            }
            for name, runs in samples.items()
        }
        calls: dict[str, collections.Counter[str]] = {n: collections.Counter() for n in names}
        for name, runs in samples.items():
            for run in runs:
                calls[name].update(run["calls"])
        out[str(concurrency)] = {
            "median": med,
            "two_vs_one_throughput": med["2 replicas"]["tokens_per_s"]
            / med["1 replica"]["tokens_per_s"],
            "two_vs_one_completions": med["2 replicas"]["completions_per_s"]
            / med["1 replica"]["completions_per_s"],
            "calls_per_sampler": {n: dict(c) for n, c in calls.items()},
            "warm_up_round": {
                n: {k: w[k] for k in ("seconds", "tokens_per_s")} for n, w in warm.items()
            },
            "samples": samples,
        }
    return out


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    from clients.sampler import SamplerPool

    model = model_dir(a.model_size)
    run_dir = WORK_DIR / f"sampler_replicas-{os.getpid()}"
    requests = build_requests(a)
    settings = {
        "max_n": max(16, a.group_size),
        "max_prompts_per_request": max(256, a.prompts_per_call),
        "kv_cache_gib": KV_CACHE_GIB,
        "max_num_seqs": MAX_NUM_SEQS,
    }
    startup: dict[str, Any] = {}
    started = time.perf_counter()
    procs = []
    placement = replica_placement(a.bind)
    for i in range(2):  # both engines start at once (Popen in the constructor)
        with bind_environment(a.bind, i):
            procs.append(
                SamplerProcess(
                    model,
                    run_dir / f"s{i}",
                    name=f"sampler-{i}",
                    settings=settings,
                    omp_threads=1,
                    cpus=placement.get(f"sampler-{i}"),
                )
            )
    pools: dict[str, Any] = {}
    try:
        for i, proc in enumerate(procs):
            startup[f"sampler_{i}_process_to_serving_s"] = proc.wait_ready()
            startup[f"sampler_{i}_engine_s"] = proc.engine_start_s()
        startup["both_serving_s"] = time.perf_counter() - started
        cores = [omp_cores(p) for p in procs]
        addresses = [p.address for p in procs]
        pools = {name: SamplerPool(addresses[:k]) for name, k in SIDES.items()}
        # The first Generate after start is far slower than later ones: one per sampler, at once.
        first = time.perf_counter()
        singles = [SamplerPool([address]) for address in addresses]
        await asyncio.gather(*(pool.generate(requests[0]) for pool in singles))
        await asyncio.gather(*(pool.close() for pool in singles))
        startup["first_call_s"] = time.perf_counter() - first
        print(f"both samplers serving in {startup['both_serving_s']:.0f} s", flush=True)
        results = await measure(pools, requests, a)
    finally:
        await asyncio.gather(*(pool.close() for pool in pools.values()))
        for proc in procs:
            proc.stop()

    cpus = os.cpu_count() or 1
    # Placed replicas each run on CPUs of their own, front end included: they add up.
    measurable = cpus >= 2 * CORES_PER_REPLICA or bool(placement)
    top = results[str(max(a.concurrency))]
    return {
        "workload": {
            "model_size": a.model_size,
            "parameters": model_parameters(model),
            "prompts_per_round": a.prompts,
            "prompts_per_call": a.prompts_per_call,
            "calls_per_round": len(requests),
            "group_size": a.group_size,
            "max_tokens": a.max_tokens,
            "ignore_eos": not a.eos,
            "temperature": 1.0,
            "logprobs": True,
            "concurrency": a.concurrency,
            "repeats": a.repeats,
            "sampler_settings": settings,
            "sampler_omp_threads": 1,
        },
        "startup_s": startup,
        "bind": a.bind,
        "placement": {name: cpus for name, cpus in placement.items()},  # RLFLEET_CPUS per sampler
        "omp_core_ids": cores,  # per sampler, from its engine's log
        "two_vs_one_throughput": top["two_vs_one_throughput"],
        "two_vs_one_completions": top["two_vs_one_completions"],
        "at_concurrency": max(a.concurrency),
        "two_replicas": {
            "cpus": cpus,
            "scaling_measurable": measurable,
            "note": (
                "2 replicas have cores of their own: the ratio is the replicas' scaling"
                if measurable
                else f"2 engines on {cpus} shared CPU cores cannot scale (each needs about "
                f"{CORES_PER_REPLICA}): the ratio measures two engines time-slicing the cores "
                "1 replica already uses (smaller batches each), not the pool's balancing"
            ),
        },
        "by_concurrency": results,
    }


def print_table(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"\n{w['model_size']} model ({w['parameters'] / 1e6:.1f}M params): {w['prompts_per_round']}"
        f" prompts per round in {w['calls_per_round']} calls of {w['prompts_per_call']}, "
        f"n={w['group_size']} x {w['max_tokens']} tokens, ignore_eos={w['ignore_eos']}, "
        f"medians of {w['repeats']}"
    )
    header = (
        f"{'concurrency':>11} {'side':11} {'tokens/s':>9} {'compl/s':>8} {'s/round':>8} "
        f"{'vs 1':>6}  calls per sampler"
    )
    print(header)
    print("-" * len(header))
    for level, res in r["by_concurrency"].items():
        base = res["median"]["1 replica"]["tokens_per_s"]
        for name, med in res["median"].items():
            calls = " ".join(
                f"{addr.rsplit(':', 1)[-1]}:{n}"
                for addr, n in sorted(res["calls_per_sampler"][name].items())
            )
            print(
                f"{level:>11} {name:11} {med['tokens_per_s']:9.0f} {med['completions_per_s']:8.1f} "
                f"{med['seconds']:8.2f} {med['tokens_per_s'] / base:5.2f}x  {calls}"
            )
    print(f"vLLM worker cores per sampler ({r['bind']}): {', '.join(map(str, r['omp_core_ids']))}")
    print(
        f"two_vs_one_throughput = {r['two_vs_one_throughput']:.2f}x at concurrency "
        f"{r['at_concurrency']} ({r['two_replicas']['note']})"
    )
    s = r["startup_s"]
    engines = ", ".join(
        f"{s[f'sampler_{i}_engine_s'] or float('nan'):.0f} s" for i in range(len(SIDES))
    )
    print(
        f"start-up: both samplers serving {s['both_serving_s']:.0f} s (engines {engines}, "
        f"started together); first calls {s['first_call_s']:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "small", "base100m"])
    parser.add_argument("--prompts", type=int, default=128, help="prompts per round")
    parser.add_argument("--prompts-per-call", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eos", action="store_true", help="stop at EOS (default: ignore_eos)")
    parser.add_argument(
        "--bind",
        choices=["auto", "distinct", "placement"],
        default="auto",
        help="vLLM worker binding: auto (vLLM's default), a core per sampler (worker only), or "
        "placement (as `rlfleet up` places 2 replicas: worker and process on their CPUs)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    info = machine()
    result = asyncio.run(amain(a))
    print_table(result)
    write_results(a.out, {"machine": info, **result})


if __name__ == "__main__":
    main()
