"""GameLink ticks/s and reply latency for the Python, TypeScript and C++ clients, beside EnvService.

One env server runs as its own process (`python -m launch.cli serve env_server`) with
`game_link: {enabled: true, policy: random}` (the policy pass, uniform sampling, is part of
every reply; no fragments are published, so no NATS). Each client kind runs as a subprocess:
the Python SDK (this file, `client` mode), `sdk/typescript/dist/bench/link_bench.js` and
`sdk/cpp/build/link_bench`. A client opens L links concurrently (threads, or promises in Node),
each with N agents of a CartPole-shaped game that costs nothing to step (Box(4) float32
observations, Discrete(2) actions, constant values), runs W warm-up ticks per link, then a fixed
number of ticks per link, lock step (max_in_flight 1) or pipelined (max_in_flight 4: submit
until 4 are unanswered, then receive one per submit). A tick's latency is submit -> its reply.

In the same run, EnvService: one Session of N envs of `TickEnv` (below: the same spaces and the
same zero cost, preloaded by reference on the same server) stepped in lock step with
pre-generated actions, and CartPole-v1 at 64 envs for scale.

    python -m bench.transport.game_link           # the full grid
    python -m bench.transport.game_link --quick   # 8/64 agents, 1/4 links, fewer ticks (own file)

Writes bench/results/game_link.json with the full table and the two targets, measured again
after the grid in `--rounds` alternating rounds (the shared machine's load swings) as medians:
- `lockstep_p50_ms_8_agents`: median reply latency of one lock-step link of 8 agents (the
  Python SDK's; every client's is in the table); target < 2 ms.
- `pipelined_vs_envservice_ratio`: pipelined GameLink agent-steps/s at 64 agents x 1 link
  (Python SDK) over EnvService env-steps/s of one Session of 64 TickEnvs; target >= 0.8.
`policy: learner` needs a learner to follow, so the learner's MLP is not run through the
server: `policy_pass_us` is one hub pass in this process (random vs the default 64x64 MLP) at
8, 64 and 1024 observations, what a reply would add with that policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from signal import SIGTERM
from typing import Any

import gymnasium as gym
import numpy as np

from bench._shared.results import RESULTS_DIR, ROOT, results_json
from services.bus.nats_server import parent_death_signal

RESULTS = RESULTS_DIR / "game_link.json"
TS_CLIENT = ROOT / "sdk" / "typescript" / "dist" / "bench" / "link_bench.js"
CPP_CLIENT = ROOT / "sdk" / "cpp" / "build" / "link_bench"
TICK_ENV = "bench/transport/game_link.py:TickEnv"  # a reference the env server preloads
ENV_ID = "BenchTick-v0"  # what the bench games declare in Hello
TARGET_P50_MS = 2.0
TARGET_RATIO = 0.8
PIPELINED_IN_FLIGHT = 4
OBS_SIZE = 4


class TickEnv(gym.Env[np.ndarray, np.int64]):
    """CartPole's spaces at no cost: constant observations, reward 0, never ends (the games the
    bench clients play are the same)."""

    def __init__(self, render_mode: str | None = None) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (OBS_SIZE,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._obs = np.full(OBS_SIZE, 0.5, np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action: Any) -> Any:
        return self._obs, 0.0, False, False, {}


# --------------------------------------------------------------------------- the Python client


def python_client(address: str, agents: int, links: int, ticks: int, warmup: int, k: int) -> dict:
    """What the TS and C++ bench clients do, with clients.game_link: L threads."""
    from clients.game_link import GameLink

    env = TickEnv()
    obs = np.full((agents, OBS_SIZE), 0.5, np.float32)
    zeros, falses = np.zeros(agents, np.float32), np.zeros(agents, np.bool_)
    ids = np.arange(agents, dtype=np.int64)
    arrays = (obs, zeros, falses, falses, ids)
    barrier = threading.Barrier(links + 1)
    latencies: list[list[float]] = [[] for _ in range(links)]
    errors: list[BaseException] = []
    granted: list[int] = []

    def run(index: int) -> None:
        try:
            link = GameLink(
                address,
                game="bench-python",
                env_id=ENV_ID,
                observation_space=env.observation_space,
                action_space=env.action_space,
                num_agents=agents,
                max_in_flight=k,
            )
            granted.append(link.max_in_flight)
            drive(link, warmup, [])
            barrier.wait()
            drive(link, ticks, latencies[index])
            barrier.wait()
            link.close("bench done")
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    def drive(link: Any, count: int, out: list[float]) -> None:
        sent: list[float] = []
        start_tick = link.last_tick
        for tick in range(start_tick + 1, start_tick + count + 1):
            if len(sent) - len(out) >= link.max_in_flight:
                link.receive()
                out.append(time.perf_counter() - sent[len(out)])
            sent.append(time.perf_counter())
            link.submit(tick, *arrays)
        while len(out) < len(sent):
            link.receive()
            out.append(time.perf_counter() - sent[len(out)])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(links)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()  # every link connected and warmed up
        started = time.perf_counter()
        barrier.wait()  # every link ran its ticks
        seconds = time.perf_counter() - started
    except threading.BrokenBarrierError:
        raise RuntimeError(f"python client failed: {errors[:1]}") from None
    for thread in threads:
        thread.join()
    return {
        "seconds": seconds,
        "ticks": ticks * links,
        "in_flight": min(granted),
        "latencies_us": [round(s * 1e6, 1) for per in latencies for s in per],
    }


# --------------------------------------------------------------------------- the server


def start_server(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    from services.server import wait_for_health

    config = tmp / "run.yaml"
    game_link = (
        "{enabled: true, policy: random, max_links: 64, max_in_flight: 8, resume_window_s: 1}"
    )
    config.write_text(
        f"run:\n  name: bench-game-link\n  dir: {tmp}/run\n"
        "services:\n  - name: env-bench\n    service: env_server\n"
        f"    settings:\n      preload: ['{TICK_ENV}']\n      game_link: {game_link}\n"
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RLFLEET_LOG_LEVEL": "WARNING",
        "RLFLEET_RUN_NAME": "bench-game-link",
        "RLFLEET_RUN_DIR": f"{tmp}/run",
    }
    env.pop("RLFLEET_NATS_URL", None)  # random policy, no fragments: no bus
    cmd = [sys.executable, "-m", "launch.cli", "serve", "env_server", "--config", str(config)]
    cmd += ["--name", "env-bench", "--port", str(port)]
    server = subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, preexec_fn=parent_death_signal(SIGTERM)
    )
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout_s=90)
    except BaseException:
        server.kill()
        raise
    return server


# --------------------------------------------------------------------------- measurements


def client_command(
    kind: str, address: str, agents: int, links: int, ticks: int, warmup: int, k: int
) -> list[str]:
    args = [address, str(agents), str(links), str(ticks), str(warmup), str(k)]
    if kind == "python":
        return [sys.executable, "-m", __spec__.name, "client", *args]  # run with cwd=ROOT
    if kind == "ts":
        return ["node", str(TS_CLIENT), *args]
    return [str(CPP_CLIENT), *args]


def run_client(
    kind: str, address: str, agents: int, links: int, ticks: int, warmup: int, k: int
) -> dict:
    cmd = client_command(kind, address, agents, links, ticks, warmup, k)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=parent_death_signal(SIGTERM),  # (dies with the bench, however that ends)
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{kind} client {cmd[1:]} failed ({done.returncode}): {done.stderr[-2000:]}"
        )
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    us = np.array(raw["latencies_us"], dtype=np.float64)
    if len(us) != raw["ticks"]:
        raise RuntimeError(f"{kind} client: {len(us)} latencies for {raw['ticks']} ticks")
    ticks_per_s = raw["ticks"] / raw["seconds"]
    return {
        "client": kind,
        "mode": "lockstep" if k == 1 else "pipelined",
        "agents": agents,
        "links": links,
        "in_flight": raw["in_flight"],
        "ticks": raw["ticks"],
        "seconds": raw["seconds"],
        "ticks_per_s": ticks_per_s,
        "agent_steps_per_s": ticks_per_s * agents,
        "p50_ms": float(np.percentile(us, 50)) / 1e3,
        "p99_ms": float(np.percentile(us, 99)) / 1e3,
    }


async def envservice_sps(address: str, env_id: str, num_envs: int, steps: int) -> float:
    """Env-steps/s of one Session of `num_envs` envs in lock step (pre-generated actions)."""
    from clients.env import EnvSession

    actions = np.random.default_rng(0).integers(0, 2, size=(256, num_envs), dtype=np.int64)
    async with EnvSession(address) as session:
        await session.create(env_id, num_envs, seed=0)
        await session.reset()
        for k in range(20):
            await session.step(actions[k % 256])
        started = time.perf_counter()
        for k in range(steps):
            await session.step(actions[k % 256])
        return steps * num_envs / (time.perf_counter() - started)


def headline_rounds(
    address: str, clients: list[str], rounds: int, ticks: int, warmup: int
) -> dict[str, Any]:
    """The two target numbers, in alternating rounds (the shared machine's load comes and goes,
    so interleaving keeps it from favouring one side): medians over the rounds. The targets are
    the Python SDK's (EnvService's client is Python too); the other SDKs' ratios come along."""
    p50s: list[float] = []
    ratios: dict[str, list[float]] = {kind: [] for kind in clients}
    samples = []
    for _ in range(rounds):
        lockstep = run_client("python", address, 8, 1, ticks, warmup, 1)
        service = asyncio.run(envservice_sps(address, TICK_ENV, 64, ticks))
        sample = {
            "lockstep_8x1_p50_ms": lockstep["p50_ms"],
            "envservice_64_env_steps_per_s": service,
        }
        for kind in clients:
            pipelined = run_client(kind, address, 64, 1, ticks, warmup, PIPELINED_IN_FLIGHT)
            ratios[kind].append(pipelined["agent_steps_per_s"] / service)
            sample[f"{kind}_pipelined_64x1_agent_steps_per_s"] = pipelined["agent_steps_per_s"]
        p50s.append(lockstep["p50_ms"])
        samples.append(sample)
    medians = {kind: float(np.median(values)) for kind, values in ratios.items()}
    return {"p50_ms": float(np.median(p50s)), "ratios": medians, "rounds": samples}


def policy_pass_us(batches: list[int], repeats: int = 50) -> dict[str, dict[str, float]]:
    """What one hub pass costs per batch size, in this process: uniform sampling (the random
    policy measured above) and the learner's default MLP actor-critic (`policy: learner`, which
    needs a learner to follow, so its cost is measured here rather than through the server)."""
    from common.behaviour import RandomBehaviour, TorchBehaviour
    from common.policy_config import PolicyConfig

    env = TickEnv()
    mlp = TorchBehaviour(env.observation_space, env.action_space, PolicyConfig(), seed=0)
    result: dict[str, dict[str, float]] = {}
    for n in batches:
        obs = np.full((n, OBS_SIZE), 0.5, np.float32)
        uniform = RandomBehaviour(env.action_space, n, 0)
        row = {}
        for name, policy in (("random", uniform), ("mlp_64x64", mlp)):
            for _ in range(20):
                policy.act(obs)
            chunks = []  # the median of 5 timed chunks: a load spike spoils one, not the result
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(repeats):
                    policy.act(obs)
                chunks.append((time.perf_counter() - started) / repeats * 1e6)
            row[name] = float(np.median(chunks))
        result[str(n)] = row
    return result


def ticks_per_link(base: int, links: int) -> int:
    """About `base` ticks per configuration, at least 50 per link."""
    return max(50, base // links)


def _versions() -> dict[str, str]:
    names = ("grpcio", "protobuf", "numpy")
    versions = {n: metadata.version(n) for n in names} | {"python": platform.python_version()}
    node = subprocess.run(["node", "--version"], capture_output=True, text=True, check=False)
    return versions | {"node": node.stdout.strip()}


def print_table(rows: list[dict], service: list[dict]) -> None:
    print("GameLink (random policy on the server): per configuration, all links together")
    head = (
        f"{'client':>6} {'mode':>9} {'agents':>6} {'links':>5} {'ticks/s':>9} {'agent-steps/s':>13}"
    )
    print(head + f" {'p50 ms':>7} {'p99 ms':>7}")
    for r in rows:
        print(
            f"{r['client']:>6} {r['mode']:>9} {r['agents']:>6} {r['links']:>5} "
            f"{r['ticks_per_s']:>9,.0f} {r['agent_steps_per_s']:>13,.0f} "
            f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}"
        )
    print("EnvService: one Session, lock step")
    for s in service:
        print(
            f"{s['env_id']:>24} {s['num_envs']:>4} envs {s['env_steps_per_s']:>10,.0f} env-steps/s"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:  # a Python bench client (what run_client starts)
        address, *numbers = argv[1:]
        agents, links, ticks, warmup, k = (int(x) for x in numbers)
        print(json.dumps(python_client(address, agents, links, ticks, warmup, k)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8/64 agents, 1/4 links, fewer ticks")
    parser.add_argument("--clients", nargs="+", default=["python", "ts", "cpp"])
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--links", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--ticks", type=int, default=1000, help="per configuration, over its links")
    parser.add_argument("--warmup", type=int, default=20, help="ticks per link before measuring")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the targets")
    parser.add_argument("--out", type=Path, help=f"default {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.quick:  # (its own file: a quick run does not replace the full run's results)
        args.agents, args.links, args.ticks, args.rounds = [8, 64], [1, 4], 600, 1
        args.out = args.out or RESULTS.with_name("game_link_quick.json")
    args.out = args.out or RESULTS
    for kind, path in (("ts", TS_CLIENT), ("cpp", CPP_CLIENT)):
        if kind in args.clients and not path.exists():
            parser.error(f"{kind} client {path} is missing: run `make sdk-{kind}` first")

    from services.ports import free_port

    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    service: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-game-link-") as tmp:
        port = free_port()
        server = start_server(Path(tmp), port)
        address = f"127.0.0.1:{port}"
        try:
            for n in sorted({*args.agents, 64}):
                sps = asyncio.run(envservice_sps(address, TICK_ENV, n, max(200, args.ticks)))
                service.append({"env_id": TICK_ENV, "num_envs": n, "env_steps_per_s": sps})
            sps = asyncio.run(envservice_sps(address, "CartPole-v1", 64, max(200, args.ticks // 2)))
            service.append({"env_id": "CartPole-v1", "num_envs": 64, "env_steps_per_s": sps})
            for kind in args.clients:
                for agents in args.agents:
                    for links in args.links:
                        for k in (1, PIPELINED_IN_FLIGHT):
                            per_link = ticks_per_link(args.ticks, links)
                            rows.append(
                                run_client(kind, address, agents, links, per_link, args.warmup, k)
                            )
                            print(
                                f"  {rows[-1]['client']} {rows[-1]['mode']} {agents}x{links}: "
                                f"{rows[-1]['ticks_per_s']:,.0f} ticks/s",
                                flush=True,
                            )
            clients = sorted({"python", *args.clients})
            headline = headline_rounds(address, clients, args.rounds, args.ticks, args.warmup)
        finally:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)

    print_table(rows, service)
    policy = policy_pass_us([8, 64, 1024])
    print(
        "one policy pass in-process, us: "
        + ", ".join(
            f"{n}: random {r['random']:.0f} / MLP {r['mlp_64x64']:.0f}" for n, r in policy.items()
        )
    )
    p50, ratio = headline["p50_ms"], headline["ratios"]["python"]
    verdict = "meets" if p50 < TARGET_P50_MS else "MISSES"
    print(f"target lock-step p50 < {TARGET_P50_MS} ms, 1 link x 8 agents: {verdict} ({p50:.2f} ms)")
    verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
    print(f"target pipelined 64x1 >= {TARGET_RATIO}x EnvService 64 envs: {verdict} ({ratio:.2f}x)")
    others = ", ".join(f"{kind} {r:.2f}x" for kind, r in headline["ratios"].items())
    print(f"  the same ratio per SDK: {others}")

    result = {
        "benchmark": "game_link",
        "lockstep_p50_ms_8_agents": p50,
        "pipelined_vs_envservice_ratio": ratio,
        "definitions": {
            "lockstep_p50_ms_8_agents": (
                "median submit->reply latency of a lock-step link of 8 agents (Python SDK, as "
                f"EnvService's client is Python), the median over {args.rounds} rounds"
            ),
            "pipelined_vs_envservice_ratio": (
                f"pipelined (max_in_flight {PIPELINED_IN_FLIGHT}) GameLink agent-steps/s at 64 "
                "agents x 1 link (Python SDK) / EnvService env-steps/s of one lock-step Session of "
                f"64 {TICK_ENV}, the median over {args.rounds} alternating rounds"
            ),
        },
        "pipelined_vs_envservice_ratio_by_sdk": headline["ratios"],
        "headline_rounds": headline["rounds"],
        "policy_pass_us": policy,
        "targets": {
            "lockstep_p50_ms_8_agents_max": TARGET_P50_MS,
            "pipelined_vs_envservice_ratio_min": TARGET_RATIO,
        },
        "rows": rows,
        "envservice": service,
        "settings": {
            "ticks_per_configuration": args.ticks,
            "warmup_ticks_per_link": args.warmup,
            "quick": args.quick,
        },
        "wall_s": time.perf_counter() - started,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            # other work on the shared machine skews every number; compare ratios, not seconds
            "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "versions": _versions(),
        "command": " ".join(["python", "-m", "bench.transport.game_link", *argv]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(results_json(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
