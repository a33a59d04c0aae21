"""The gateway with agents: its training mode against the multi-turn rollout driver, and serving
with tools against vLLM's own OpenAI server, each pair on one model and one vLLM sampler.

1. ``gateway_vs_driver_episodes_ratio`` (target >= 0.8): Calculator episodes per second.
   - driver: the rollout driver's own loop (clients.env.episodes.play_group with
     sampler/rollout/turns.py's turns) on Calculator-v0 served by an env server process, groups of
     ``--group-size`` episodes, ``--concurrency`` groups in flight;
   - gateway: ``rlfleet serve gateway`` in training mode over the same sampler (NATS, its prompt
     queue fed from the arith generator's 3-digit products), ``--group-size x --concurrency``
     agents at once, each written as examples/agent_openai.py is (the official ``openai``
     client, the same system prompt, tool and result format): start a session, call the model
     (tools offered) until it answers, the tool run by the agent, report the reward. An episode
     counts when its reward is taken.
   Both cap an episode at ``--max-turns`` model calls of ``--max-tokens`` tokens at temperature
   1; what differs is the path: token ids over gRPC from an env server, or OpenAI JSON over HTTP
   through the gateway, which records every call.
2. ``tools_throughput_ratio`` (target >= 0.9): chat completions with the calculator tool offered,
   ``--serve-concurrency`` clients, through the serving gateway (``rlfleet serve gateway`` over a
   sampler process) against vLLM's OpenAI server with its hermes tool parser
   (``--enable-auto-tool-choice --tool-call-parser hermes``), requests per second.

Two workloads (``--workloads``), each on its own sampler:
- ``tool_calling`` (the headline ratios): examples/agent_calculator.yaml's model after its SFT
  warm start (bench.lm.agent_vs_trl's shared post-SFT model, made once): it calls the tool and
  then answers, so an episode is the multi-turn exchange both paths exist for;
- ``untrained``: ``init-model``'s tiny size with its tokenizer trained on Calculator-v0's
  episodes; it answers at once, so every episode is one call and the gateway's per-session
  requests (start, reward) weigh most: the path's worst case, episodes only.
Each round also reports the CPU milliseconds per episode of every process (where the cost goes).

    .venv/bin/python -m bench.lm.agent_gateway

Writes bench/results/agent_gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench._shared.cpu import CpuClock
from bench._shared.lm import SamplerProcess, service_process, stop_process, vllm_environment
from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, median, write_results
from bench.serving.gateway import HttpProcess, gateway_process

RESULTS = RESULTS_DIR / "agent_gateway.json"
ENV_ID = "Calculator-v0"
MODEL = "tiny"
TARGETS = {"gateway_vs_driver_episodes_ratio": 0.8, "tools_throughput_ratio": 0.9}
WORKLOADS = ("tool_calling", "untrained")  # the first gives the headline ratios
SYSTEM = (
    "You are a careful assistant. Use the calculator tool for arithmetic, then give the final "
    "answer as <answer>NUMBER</answer>."
)


def calculator_model() -> Path:
    """The tiny model with its tokenizer trained on Calculator-v0's episodes (made once)."""
    from common.models import init_model

    path = WORK_DIR / "models" / "tiny-calculator"
    if not (path / "config.json").is_file():
        print(f"creating {path} ...", flush=True)
        init_model(path, size="tiny", env={"env_id": ENV_ID})
    return path


def env_tools() -> list[dict[str, Any]]:
    """Calculator-v0's tools with their keys sorted, as the model saw them in training (the
    fleet renders tools so); vLLM's server renders the client's key order, and the same tools in
    another order make a prompt the tiny model never saw."""
    from common.models import canonical_tools
    from env_server.registry import make_text_env

    return canonical_tools(make_text_env(ENV_ID).tools) or []


# --------------------------------------------------------------------------- 1. the driver


async def driver_round(
    env_address: str, sampler: Any, tokenizer: Any, seeds: list[int], a: argparse.Namespace
) -> dict[str, Any]:
    from clients.env.episodes import ChatTokens, EpisodeLimits, play_group
    from clients.env.text import TextSession
    from rlfleet.sampler.v1 import sampler_pb2
    from sampler.rollout.turns import sampler_turns

    limits = EpisodeLimits(max_turns=a.max_turns, max_total_tokens=a.max_total_tokens)
    queue = list(seeds)
    totals = {"episodes": 0, "calls": 0, "prompt_tokens": 0, "completion_tokens": 0}

    async def worker() -> None:
        async with TextSession(env_address) as session:
            info = await session.create(ENV_ID, a.group_size, kwargs={"max_turns": a.max_turns})
            tokens = ChatTokens(tokenizer, info.tools)
            # As the rollout driver asks: a model turn ends at the template's end of turn.
            sampling = sampler_pb2.SamplingParams(
                temperature=1.0, max_tokens=a.max_tokens, stop_token_ids=sorted(tokens.turn_end)
            )
            turns = sampler_turns(sampler, sampling)
            while queue:
                seed = queue.pop()
                episodes = await play_group(session, seed, a.group_size, tokens, turns, limits)
                totals["episodes"] += len(episodes)
                totals["calls"] += sum(e.turns for e in episodes)
                totals["prompt_tokens"] += sum(e.prompt_tokens for e in episodes)
                totals["completion_tokens"] += sum(sum(e.loss_mask) for e in episodes)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    seconds = time.perf_counter() - started
    return {**totals, "seconds": seconds, "episodes_per_s": totals["episodes"] / seconds}


# --------------------------------------------------------------------------- 1. the gateway


def training_gateway(sampler: str, nats_url: str, run: str, a: argparse.Namespace) -> HttpProcess:
    from services.ports import free_port

    port = free_port()
    training = {
        "group_size": a.group_size,
        "dataset": {"generator": "arith", "digits": 3, "ops": ["*"], "seed": 0},
        "max_calls_per_session": a.max_turns,
        "max_session_tokens": a.max_total_tokens,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    env.update(
        RLFLEET_RUN_NAME=run,
        RLFLEET_RUN_DIR=str(WORK_DIR / "agent_gateway"),
        RLFLEET_NATS_URL=nats_url,
        RLFLEET_LOG_LEVEL="WARNING",
        PYTHONPATH=str(ROOT),
        RLFLEET_GATEWAY__SAMPLERS=json.dumps([sampler]),
        RLFLEET_GATEWAY__HTTP_PORT=str(port),
        RLFLEET_GATEWAY__SERVED_MODEL_NAME=MODEL,
        RLFLEET_GATEWAY__TRAINING=json.dumps(training),
    )
    cmd = [sys.executable, "-m", "launch.cli", "serve", "gateway", "--name", "gateway-train"]
    proc = HttpProcess("gateway-train", cmd, env, WORK_DIR / "agent_gateway")
    proc.port, proc.url = port, f"http://127.0.0.1:{port}"
    return proc


def answer_of(text: str) -> int | None:
    from env_server.text.envs import answer_of as env_answer

    return env_answer(text)


async def agent_round(url: str, episodes: int, a: argparse.Namespace) -> dict[str, Any]:
    """``episodes`` sessions played by ``group_size x concurrency`` agents at once."""
    import httpx
    import openai

    from env_server.text.envs import calculate

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    http = httpx.AsyncClient(base_url=url, timeout=300)
    tools = env_tools()
    left = [episodes]
    totals = {
        "episodes": 0, "calls": 0, "unavailable": 0, "prompt_tokens": 0, "completion_tokens": 0
    }  # fmt: skip

    async def session() -> None:
        started = await http.post("/rlfleet/v1/sessions", json={})
        if started.status_code == 503:
            totals["unavailable"] += 1
            return
        started.raise_for_status()
        body = started.json()
        headers = {"X-Rlfleet-Session": body["session_id"]}
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": body["task"]["prompt"]},
        ]
        said = ""
        for _ in range(a.max_turns):
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, tools=tools, max_tokens=a.max_tokens,
                temperature=1.0, extra_headers=headers,
            )  # fmt: skip
            reply = answer.choices[0].message
            totals["calls"] += 1
            if answer.usage is not None:
                totals["prompt_tokens"] += answer.usage.prompt_tokens
                totals["completion_tokens"] += answer.usage.completion_tokens
            if not reply.tool_calls:
                said = reply.content or ""
                break
            messages.append(reply.model_dump(exclude_none=True))
            for call in reply.tool_calls:
                try:
                    result: Any = {
                        "result": calculate(json.loads(call.function.arguments)["expression"])
                    }
                except Exception as exc:  # the model's arguments are whatever it wrote
                    result = {"error": f"{type(exc).__name__}: {exc}"}
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps(result, sort_keys=True)})  # fmt: skip
        right = answer_of(said) == int(body["task"]["extra"]["answer"])
        rewarded = await http.post(
            f"/rlfleet/v1/sessions/{body['session_id']}/reward",
            json={"reward": 1.0 if right else 0.0},
        )
        rewarded.raise_for_status()
        totals["episodes"] += 1

    async def agent() -> None:
        while left[0] > 0:
            left[0] -= 1
            await session()

    started = time.perf_counter()
    await asyncio.gather(*(agent() for _ in range(a.group_size * a.concurrency)))
    seconds = time.perf_counter() - started
    await client.close()
    await http.aclose()
    return {**totals, "seconds": seconds, "episodes_per_s": totals["episodes"] / seconds}


# --------------------------------------------------------------------------- 2. serving tools


def vllm_tools_process(model: Path, run_dir: Path) -> HttpProcess:
    from services.ports import free_port

    env = {**os.environ, **vllm_environment(run_dir)}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(free_port()),
        "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512",
        "--max-num-seqs", "64", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    return HttpProcess("vllm-openai-tools", cmd, env, run_dir)


async def tools_load(
    url: str, requests: int, turn_end: list[int], a: argparse.Namespace
) -> dict[str, Any]:
    """``requests`` chat calls with the tool offered; ``turn_end`` (the template's end of turn)
    is asked as a stop token of both servers: the gateway's sampler stops there for every chat
    prompt, vLLM's server only at the EOS of the model's generation config."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=300)
    tools = env_tools()
    queue = list(range(requests))
    counts = {"ok": 0, "errors": 0, "tool_calls": 0, "completion_tokens": 0}

    async def worker() -> None:
        while queue:
            i = queue.pop()
            try:
                answer = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"What is {100 + i} * {917 - i}?"}],
                    tools=tools, max_tokens=a.max_tokens, temperature=1.0,
                    extra_body={"stop_token_ids": turn_end},
                )  # fmt: skip
            except openai.APIError:
                counts["errors"] += 1
                continue
            counts["ok"] += 1
            counts["tool_calls"] += bool(answer.choices[0].message.tool_calls)
            counts["completion_tokens"] += answer.usage.completion_tokens if answer.usage else 0

    await asyncio.gather(*(worker() for _ in range(min(a.serve_concurrency, 4))))  # warm-up
    queue[:] = list(range(requests))
    counts.update(ok=0, errors=0, tool_calls=0, completion_tokens=0)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(a.serve_concurrency)))
    seconds = time.perf_counter() - started
    await client.close()
    return {**counts, "seconds": seconds, "requests_per_s": counts["ok"] / seconds}


# --------------------------------------------------------------------------- the run


def workload_model(workload: str) -> Path:
    if workload == "untrained":
        return calculator_model()
    from bench.lm.agent_vs_trl import post_sft_model
    from bench.lm.grpo_vs_trl import load_job

    _, settings = load_job(ROOT / "examples" / "agent_calculator.yaml")
    return post_sft_model(settings)


async def amain(a: argparse.Namespace, model: Path, serve: bool) -> dict[str, Any]:
    """One workload on ``model``: the episodes pair, then (``serve``) the serving pair."""
    from transformers import AutoTokenizer

    from clients.env.episodes import ChatTokens
    from clients.sampler import SamplerClient
    from common.datasets import ENV_SEED_KEY, env_seeds
    from services.bus import EmbeddedNats

    run_dir = WORK_DIR / f"agent_gateway-{os.getpid()}"
    tokenizer = AutoTokenizer.from_pretrained(model)
    turn_end = ChatTokens(tokenizer).turn_end
    seeds = [int(t.extra[ENV_SEED_KEY]) for t in env_seeds(env_id=ENV_ID, count=a.groups)]
    settings = {"max_model_len": a.max_total_tokens, "kv_cache_gib": 1, "block_size": 32,
                "served_model_name": MODEL, "max_queued_requests": 4096}  # fmt: skip
    nats = EmbeddedNats(run_dir / "nats")
    nats.start()
    env_proc, env_address = service_process("env_server", run_dir, "env-0")
    sampler = SamplerProcess(model, run_dir / "sampler", settings=settings, omp_threads=1)
    procs: list[Any] = [sampler]
    client = None
    driver: list[dict[str, Any]] = []
    gateway: list[dict[str, Any]] = []
    tools: dict[str, list[dict[str, Any]]] = {"gateway": [], "vllm": []}
    try:
        startup = {"sampler_s": sampler.wait_ready()}
        client = SamplerClient(sampler.address)
        trainer = training_gateway(sampler.address, nats.url, f"bench-{uuid.uuid4().hex[:6]}", a)
        procs.append(trainer)
        startup["training_gateway_s"] = trainer.wait_ready(120)
        await driver_round(env_address, client, tokenizer, seeds[:2], a)  # warm-up
        await agent_round(trainer.url, a.group_size * 2, a)
        episodes = a.groups * a.group_size
        processes = {
            "bench": (os.getpid(), False),  # the agents or the driver's loop
            "sampler": (sampler.proc.pid, True),  # with its vLLM EngineCore
            "sampler_frontend": (sampler.proc.pid, False),  # gRPC, rendering, detokenizing
            "env_server": (env_proc.pid, True),
            "gateway": (trainer.proc.pid, True),
        }
        if nats.pid is not None:
            processes["nats"] = (nats.pid, False)
        clock = CpuClock(processes)
        for round_ in range(a.repeats):
            pair = [("driver", driver), ("gateway", gateway)]
            for name, into in pair if round_ % 2 == 0 else pair[::-1]:
                before = clock.read()
                if name == "driver":
                    got = await driver_round(env_address, client, tokenizer, seeds, a)
                else:
                    got = await agent_round(trainer.url, episodes, a)
                spent = clock.since(before)
                got["cpu_ms_per_episode"] = {
                    k: 1000 * v / max(got["episodes"], 1) for k, v in spent.items()
                }
                into.append(got)
                cpu = ", ".join(f"{k} {v:.1f}" for k, v in got["cpu_ms_per_episode"].items())
                print(f"round {round_ + 1} {name}: {got['episodes_per_s']:.2f} episodes/s "
                      f"({got['calls']} calls; CPU ms per episode: {cpu})", flush=True)  # fmt: skip
        trainer.stop()
        procs.remove(trainer)
        if serve:
            serving = gateway_process("gateway-serve", [sampler.address], run_dir)
            procs.append(serving)
            startup["serving_gateway_s"] = serving.wait_ready(120)
            raw = vllm_tools_process(model, run_dir / "vllm")
            procs.append(raw)
            startup["vllm_openai_server_s"] = raw.wait_ready(600)
        for round_ in range(a.repeats if serve else 0):
            for name, url in (("gateway", serving.url), ("vllm", raw.url)):
                got = await tools_load(url, a.serve_requests, turn_end, a)
                tools[name].append(got)
                print(f"round {round_ + 1} serving {name}: {got['requests_per_s']:.2f} req/s",
                      flush=True)  # fmt: skip
    finally:
        if client is not None:
            await client.close()
        for proc in reversed(procs):
            proc.stop()
        stop_process(env_proc)
        nats.stop()
    out: dict[str, Any] = {
        "gateway_vs_driver_episodes_ratio": median(r["episodes_per_s"] for r in gateway)
        / median(r["episodes_per_s"] for r in driver),
        "calls_per_episode": sum(r["calls"] for r in driver) / sum(r["episodes"] for r in driver),
        "episodes": {"driver": driver, "gateway": gateway},
        "startup_s": startup,
        "model": str(model.relative_to(ROOT)),
    }
    if serve:
        out["tools_throughput_ratio"] = median(
            r["requests_per_s"] for r in tools["gateway"]
        ) / median(r["requests_per_s"] for r in tools["vllm"])
        out["serving_with_tools"] = tools
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="tasks per round")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2, help="groups in flight")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-total-tokens", type=int, default=480)
    parser.add_argument("--serve-requests", type=int, default=64)
    parser.add_argument("--serve-concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workloads = {}
    for workload in a.workloads:
        print(f"workload {workload} ...", flush=True)
        model = workload_model(workload)
        workloads[workload] = asyncio.run(amain(a, model, serve=workload == WORKLOADS[0]))
    headline = workloads.get(WORKLOADS[0], {})
    ratios = {k: headline[k] for k in TARGETS if k in headline}
    result = {
        **ratios,
        "targets": TARGETS,
        "targets_met": {k: v >= TARGETS[k] for k, v in ratios.items()},
        "workloads": workloads,
        "settings": {k: getattr(a, k) for k in vars(a) if k != "out"} | {"env_id": ENV_ID},
        "machine": machine(),
    }
    print(f"{'workload':<14}{'':34} {'ratio':>7} {'target':>7}")
    for workload, got in workloads.items():
        for key, target in TARGETS.items():
            if key in got:
                print(f"{workload:<14}{key:34} {got[key]:7.3f} {target:7.2f}")
    write_results(a.out, result)


if __name__ == "__main__":
    main()
