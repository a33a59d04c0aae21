"""Replicas add throughput: env servers added to a training run, samplers added under load.

Env servers. `rlfleet up` trains APPO (actors up to `max_policy_lag` versions ahead, so the
learner's updates overlap collection) on `SlowCartPole` (bench/_shared/slow_envs.py: every env
step holds its server for `--step-ms`, as a simulator would; CartPole alone costs microseconds
and cannot show scaling on 2 cores) with one env server, `env-0`. While it trains, a second
and then a third replica of `env-0` join the run as a deployment adds them
(`rlfleet serve env_server --name env-0` with the run's NATS url and name): the actors find
them in the run's membership and spread their envs over them, with nothing restarted. Env
steps/s is the slope of the learner's `step` over each phase (metrics.jsonl), after a settle
time; `scaling_efficiency_3_env_servers` = steps/s with 3 / (3 x steps/s with 1).

Samplers. Two vLLM samplers, each on CPUs of its own as `rlfleet up` places replicas
(services/placement.py). One serves while `--concurrency` Generate calls of the GRPO job's
shape stay in flight through a `SamplerPool` that names the instance `sampler` (its live
replicas, services/membership.py); the second joins under the same load, and the pool sends
calls to it as soon as it registers. Tokens/s over each phase;
`scaling_efficiency_2_samplers` = tokens/s with 2 / (2 x tokens/s with 1).

    .venv/bin/python -m bench.fleet.scaling               # both parts
    .venv/bin/python -m bench.fleet.scaling --only env    # or: --only samplers

Writes bench/results/scaling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench._shared.fleet import launched, learner_steps, steps_per_s, wait_for
from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, write_results

RESULTS = RESULTS_DIR / "scaling.json"
TARGET_EFFICIENCY = 0.8


# ---------------------------------------------------------------------- env servers


def run_file(path: Path, run_dir: Path, a: argparse.Namespace) -> Path:
    config = {
        "run": {"name": f"scaling-{os.getpid()}", "dir": str(run_dir)},
        "job": {
            "kind": "appo",
            "env_id": "bench._shared.slow_envs:SlowCartPole",
            "env_kwargs": {"step_ms": a.step_ms},
            "env_servers": 1,
            "num_actors": a.actors,
            "num_envs": a.envs,
            "rollout_length": 32,
            "fragments_per_update": a.actors,
            "total_timesteps": 10_000_000,
            "update_epochs": 4,
            "minibatch_size": 256,
            "max_policy_lag": 8,
            "seed": 1,
            "device": "cpu",
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def env_part(a: argparse.Namespace) -> dict[str, Any]:
    work = WORK_DIR / f"scaling-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    path = run_file(work / "run.yaml", run_dir, a)
    phases: list[dict[str, Any]] = []
    with launched(path, work) as run:
        wait_for("training", lambda: len(learner_steps(run_dir)) >= 3, 300)
        for servers in range(1, a.max_servers + 1):
            if servers > 1:  # another replica of env-0 joins the run
                run.join_env_server("env-0", str(servers))
            time.sleep(a.settle_s)  # its start, the actors' move, the pipeline refilling
            since = time.time()
            time.sleep(a.phase_s)
            sps = steps_per_s(learner_steps(run_dir), since, time.time())
            if sps is None:
                raise RuntimeError(f"too few learner records in {a.phase_s:g} s")
            phases.append({"env_servers": servers, "steps_per_s": sps})
            print(f"  {servers} env server(s): {sps:,.0f} env steps/s", flush=True)
    one = phases[0]["steps_per_s"]
    return {
        "phases": phases,
        "speedup": {p["env_servers"]: p["steps_per_s"] / one for p in phases},
        "scaling_efficiency_2_env_servers": phases[1]["steps_per_s"] / (2 * one),
        "scaling_efficiency_3_env_servers": phases[-1]["steps_per_s"] / (len(phases) * one),
        "linear_limit_steps_per_s_per_server": 1000.0 / a.step_ms,
        "workload": {
            "env": "SlowCartPole (CartPole-v1, a sleep of step_ms per env step)",
            "step_ms": a.step_ms,
            "job": "appo",
            "actors": a.actors,
            "envs_per_actor": a.envs,
            "settle_s": a.settle_s,
            "phase_s": a.phase_s,
            "how": "env-0 replicas 2 and 3 started with `rlfleet serve env_server --name env-0` "
            "while the run trained; steps/s = slope of the learner's global step",
        },
    }


# ---------------------------------------------------------------------- samplers


async def sampler_part(a: argparse.Namespace) -> dict[str, Any]:
    from bench._shared.lm import SamplerProcess, model_dir
    from bench.lm.sampler_replicas import build_requests, replica_placement
    from clients.sampler import SamplerPool
    from common import tensor
    from services.bus import Bus, EmbeddedNats
    from services.membership import Members, PeerView

    work = WORK_DIR / f"scaling-samplers-{os.getpid()}"
    run = f"scaling-{os.getpid()}"
    model = model_dir("tiny")
    placement = replica_placement("placement")
    settings = {"max_n": 16, "max_prompts_per_request": 256, "kv_cache_gib": 1}
    requests = build_requests(
        argparse.Namespace(
            prompts=128, prompts_per_call=8, group_size=8, max_tokens=16, eos=False, seed=0
        )
    )
    procs: list[Any] = []
    tokens: list[tuple[float, int]] = []  # (time done, completion tokens) of every call
    calls: dict[str, int] = {}  # calls answered per sampler address
    with EmbeddedNats(work / "nats") as nats:

        def start(index: int) -> Any:
            proc = SamplerProcess(
                model,
                work / f"s{index}",
                name="sampler",
                run=run,
                nats_url=nats.url,
                settings=settings,
                omp_threads=1,
                cpus=placement.get(f"sampler-{index}"),
            )
            procs.append(proc)
            return proc

        bus = await Bus.connect(nats.url, name="bench-scaling")
        members = Members(bus, run)
        await members.start()
        peers = PeerView(["sampler"], kind="sampler", resolve=lambda ref: ref)
        peers.follow(members)
        pool = SamplerPool(peers, timeout_s=600)
        stop = asyncio.Event()

        async def worker(index: int) -> None:
            turn = index
            while not stop.is_set():
                request = requests[turn % len(requests)]
                turn += a.concurrency
                address, response = await pool.generate(request)
                count = sum(
                    len(tensor.decode(c.token_ids)) for r in response.results for c in r.completions
                )
                tokens.append((time.monotonic(), count))
                calls[address] = calls.get(address, 0) + 1

        try:
            await asyncio.to_thread(start(0).wait_ready)
            await asyncio.to_thread(lambda: wait_for("sampler 1 registered", peers.addresses, 30))
            workers = [asyncio.create_task(worker(i)) for i in range(a.concurrency)]
            phases = []
            for samplers in (1, 2):
                if samplers == 2:
                    await asyncio.to_thread(start(1).wait_ready)
                    await asyncio.to_thread(
                        lambda: wait_for("2 samplers", lambda: len(peers.addresses()) == 2, 30)
                    )
                await asyncio.sleep(a.settle_s)
                since = time.monotonic()
                await asyncio.sleep(a.phase_s)
                until = time.monotonic()
                done = [n for t, n in tokens if since <= t <= until]
                tps = sum(done) / (until - since)
                phases.append({"samplers": samplers, "tokens_per_s": tps, "calls": len(done)})
                print(f"  {samplers} sampler(s): {tps:,.0f} tokens/s", flush=True)
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            stop.set()
            await pool.close()
            await members.close()
            await bus.close()
            for proc in procs:
                proc.stop()
    one = phases[0]["tokens_per_s"]
    return {
        "phases": phases,
        "scaling_efficiency_2_samplers": phases[1]["tokens_per_s"] / (2 * one),
        "calls_per_sampler": calls,
        "placement": placement,
        "workload": {
            "engine": "vllm (CPU), tiny model, each replica on CPUs of its own",
            "concurrency": a.concurrency,
            "request": "8 arith prompts x n=8, 16 tokens (ignore_eos), logprobs",
            "settle_s": a.settle_s,
            "phase_s": a.phase_s,
            "how": "sampler replica 2 started while calls were in flight; the pool follows "
            "the run's membership",
        },
    }


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("env", "samplers"))
    parser.add_argument("--step-ms", type=float, default=4.0, help="SlowCartPole's step time")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--envs", type=int, default=12, help="envs per actor")
    parser.add_argument("--max-servers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="Generate calls in flight")
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--phase-s", type=float, default=20.0)
    a = parser.parse_args()
    out: dict[str, Any] = {"target_efficiency": TARGET_EFFICIENCY}
    if RESULTS.exists():  # a part run alone keeps the other's last result
        previous = json.loads(RESULTS.read_text())
        out.update({k: previous[k] for k in ("env_servers", "samplers") if k in previous})
    if a.only in (None, "env"):
        print("env servers added to a training run:", flush=True)
        out["env_servers"] = env_part(a)
    if a.only in (None, "samplers"):
        print("samplers added under load:", flush=True)
        out["samplers"] = asyncio.run(sampler_part(a))
    if "env_servers" in out:
        out["scaling_efficiency_3_env_servers"] = out["env_servers"][
            "scaling_efficiency_3_env_servers"
        ]
    if "samplers" in out:
        out["scaling_efficiency_2_samplers"] = out["samplers"]["scaling_efficiency_2_samplers"]
    out["machine"] = machine()
    out["command"] = "python -m bench.fleet.scaling " + " ".join(sys.argv[1:])
    out["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_results(RESULTS, out)
    print()
    print(f"{'measure':<36}{'value':>10}{'target':>10}")
    for key in ("scaling_efficiency_3_env_servers", "scaling_efficiency_2_samplers"):
        if key in out:
            print(f"{key:<36}{out[key]:>10.2f}{TARGET_EFFICIENCY:>10.2f}")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
