"""Env stepping through a real env_server versus in-process `gymnasium.vector.SyncVectorEnv`.

The server runs as its own process (`python -m launch.cli serve env_server --port P`), the
client steps Session streams in lock step, and every side uses the same pre-generated random
actions, so policy cost is excluded. Two remote columns: gRPC (StepRequest messages) and
co-located (the same server, steps through a shared-memory ring: docs/colocated.md; the client
waits for each answer as a game actor does, asleep in the kernel in lock step). Also
measures the round-trip latency of one single-env step on each, and the floor of the gRPC
column: a bare Python gRPC echo of the same message sizes (bench/transport/grpc_echo.py) in the
same run, which caps what lock-step stepping over gRPC can reach (`grpc_ceiling_ratio`). A third
remote column steps the co-located ring with busy polling on both ends (`colocated_busy_poll_us`, a
second server started with it): no scheduler wake-up per step, at the cost of busy cores.
A fourth steps the co-located ring with this process's stepping thread and a third server
pinned to one CPU (`RLFLEET_CPUS`), as `cpu_placement: auto` places an actor and its env
server on a 2-core machine (the learner on the other CPU): in lock step the two never run at
once, and a wake-up on the same CPU is a context switch rather than a cross-CPU interrupt.
Two double-buffered columns (gRPC and co-located, `x2`) step two streams of half the envs each
from two concurrent loops, as an actor with `double_buffer: on` does: the server steps one half
while this process handles the other half's answer.

    python -m bench.transport.env_throughput      # CartPole-v1 at 1, 16, 64, 256 envs
    python -m bench.transport.env_throughput --envs 64 --seconds 5 --busy-poll-us 1000

Prints a table and writes bench/results/env_throughput.json (machine, versions, ratios).
Targets at 64 envs on the 2-core build machine: gRPC >= 0.8x in-process steps/s
(`ratio_at_64`), co-located >= 0.9x (`colocated_ratio_at_64` with the default blocking
doorbells, placed by the OS; `colocated_one_core_ratio_at_64` on one CPU;
`colocated_busy_poll_ratio_at_64` with busy polling).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from bench._shared.results import RESULTS_DIR, ROOT, results_json
from bench.transport.grpc_echo import round_trip_us
from clients.env import EnvSession
from sampler.actors.settings import GameActorSettings
from services.ports import free_port
from services.server import wait_for_health

RESULTS = RESULTS_DIR / "env_throughput.json"
TARGET_AT_64 = 0.8
COLOCATED_TARGET_AT_64 = 0.9
# How long a lock-step game actor with one env server waits for a co-located answer asleep in
# the kernel before awaiting it in its event loop (docs/colocated.md).
ACTOR_BLOCK_US: int = GameActorSettings.model_fields["colocated_block_us"].default


def _actions(num_envs: int, count: int = 1024, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2, size=(count, num_envs), dtype=np.int64)


class LocalRun:
    """In-process SyncVectorEnv (SAME_STEP, as the server) stepping pre-generated actions."""

    def __init__(self, env_id: str, num_envs: int) -> None:
        self.envs = gym.vector.SyncVectorEnv(
            [lambda: gym.make(env_id)] * num_envs,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        self.envs.reset(seed=0)
        self.actions = _actions(num_envs)
        self.num_envs = num_envs
        self.steps = 0

    def measure(self, seconds: float) -> float:
        """Steps/s over about `seconds`."""
        steps, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            for _ in range(20):
                self.envs.step(self.actions[self.steps % len(self.actions)])
                self.steps += 1
                steps += 1
        return steps * self.num_envs / elapsed


class RemoteRun:
    """One Session stream of `num_envs` envs on the server, stepped in lock step."""

    def __init__(self, session: EnvSession, num_envs: int) -> None:
        self.session = session
        self.actions = _actions(num_envs)
        self.num_envs = num_envs
        self.steps = 0

    async def measure(self, seconds: float) -> float:
        steps, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            for _ in range(10):
                await self.session.step(self.actions[self.steps % len(self.actions)])
                self.steps += 1
                steps += 1
        return steps * self.num_envs / elapsed


class OneCoreRun(RemoteRun):
    """A RemoteRun whose stepping thread runs on `cpu` while it measures (its server is
    pinned there too)."""

    def __init__(self, session: EnvSession, num_envs: int, cpu: int) -> None:
        super().__init__(session, num_envs)
        self.cpu = cpu

    async def measure(self, seconds: float) -> float:
        with pinned_thread(self.cpu):
            return await super().measure(seconds)


@contextlib.contextmanager
def pinned_thread(cpu: int) -> Iterator[None]:
    """The calling thread on `cpu` only, then back where it was allowed before."""
    before = os.sched_getaffinity(0)  # pid 0: this thread
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def one_core_cpu() -> int:
    """Where the one-core column runs: the first CPU this process may use (where
    `cpu_placement: auto` puts every service but the learner on a 2-core machine)."""
    return min(os.sched_getaffinity(0))


class DoubleBufferedRun:
    """Two Session streams of half the envs each, stepped by two concurrent loops: one half's
    step is in flight (the server stepping it) while this process handles the other's answer,
    as an actor with `double_buffer: on` keeps one half stepping while its policy acts on the
    other. Steps/s of both halves together."""

    def __init__(self, halves: tuple[EnvSession, EnvSession], num_envs: int) -> None:
        self.halves = [
            RemoteRun(half, n) for half, n in zip(halves, _halves(num_envs), strict=True)
        ]

    async def measure(self, seconds: float) -> float:
        return sum(await asyncio.gather(*(half.measure(seconds) for half in self.halves)))


def _halves(num_envs: int) -> tuple[int, int]:
    return num_envs - num_envs // 2, num_envs // 2


async def _open(
    address: str,
    env_id: str,
    num_envs: int,
    colocated: bool,
    busy_poll_us: int = 0,
    lock_step: bool = True,
) -> EnvSession:
    """A session, reset; co-located ones wait for answers as a game actor does: blocking for
    up to its `colocated_block_us` in lock step, in the event loop when double-buffered."""
    session = EnvSession(address)
    await session.create(env_id, num_envs, seed=0)
    block_us = ACTOR_BLOCK_US if lock_step else 0
    if colocated and not await session.colocate(busy_poll_us=busy_poll_us, block_us=block_us):
        raise RuntimeError(f"the server declined the co-located ring: {session.colocate_reason}")
    await session.reset()
    return session


def _message_bytes(env_id: str, num_envs: int) -> tuple[int, int]:
    """About what one step's StepRequest and StepResponse carry: the actions; the observations,
    rewards (float32) and the two flags, each with some room for the envelope."""
    env = gym.make(env_id)
    obs_bytes = int(np.prod(env.observation_space.shape)) * env.observation_space.dtype.itemsize
    action_bytes = max(int(np.prod(env.action_space.shape or (1,))), 1) * 8
    env.close()
    return num_envs * action_bytes + 64, num_envs * (obs_bytes + 4 + 2) + 128


async def grpc_ceiling(echo: str, env_id: str, row: dict[str, Any]) -> None:
    """The best remote/local ratio a lock-step gRPC stream could reach: the in-process step
    time plus a bare echo of the step's message sizes, no protobuf and no work at all."""
    request_bytes, reply_bytes = _message_bytes(env_id, row["num_envs"])
    echo_us = await round_trip_us(echo, request_bytes, reply_bytes)
    local_step_us = row["num_envs"] / row["local_sps"] * 1e6
    row["echo_round_trip_us"] = echo_us
    row["grpc_ceiling_ratio"] = local_step_us / (local_step_us + echo_us)


async def compare(
    addresses: tuple[str, str, str],
    env_id: str,
    num_envs: int,
    seconds: float,
    rounds: int,
    busy_poll_us: int,
) -> dict:
    """Alternate short in-process, gRPC, co-located, one-core co-located and busy-polled
    co-located rounds (the build machines are shared and noisy, so interleaving keeps
    background load from favouring one side); the medians. `addresses`: the plain server, the
    busy-polling one, the one pinned to `one_core_cpu()`."""
    plain, polling, one_core = addresses
    local = LocalRun(env_id, num_envs)
    local.measure(0.2)  # warm up
    sessions = [
        await _open(plain, env_id, num_envs, colocated=False),
        await _open(plain, env_id, num_envs, colocated=True),
        await _open(polling, env_id, num_envs, colocated=True, busy_poll_us=busy_poll_us),
    ]
    remotes: list[RemoteRun | DoubleBufferedRun] = [RemoteRun(s, num_envs) for s in sessions]
    with pinned_thread(one_core_cpu()):  # its gRPC setup too, as the session's stepping
        sessions.append(await _open(one_core, env_id, num_envs, colocated=True))
    remotes.append(OneCoreRun(sessions[-1], num_envs, one_core_cpu()))
    for colocated in (False, True) if num_envs >= 2 else ():  # gRPC x2, co-located x2
        first, second = _halves(num_envs)
        pair = (
            await _open(plain, env_id, first, colocated=colocated, lock_step=False),
            await _open(plain, env_id, second, colocated=colocated, lock_step=False),
        )
        sessions += pair
        remotes.append(DoubleBufferedRun(pair, num_envs))
    try:
        for remote in remotes:
            await remote.measure(0.2)
        local_sps: list[float] = []
        remote_sps: list[list[float]] = [[] for _ in remotes]
        for _ in range(rounds):
            local_sps.append(local.measure(seconds / rounds))
            for remote, sps in zip(remotes, remote_sps, strict=True):
                sps.append(await remote.measure(seconds / rounds))
    finally:
        for session in sessions:
            await session.close()
    local.envs.close()
    lo = float(np.median(local_sps))
    re, co, polled, one_core_sps, *double = (float(np.median(sps)) for sps in remote_sps)
    double_rows = {}
    if double:
        double_rows = {
            "double_buffer_sps": double[0],
            "double_buffer_ratio": double[0] / lo,
            "colocated_double_buffer_sps": double[1],
            "colocated_double_buffer_ratio": double[1] / lo,
        }
    return {
        "num_envs": num_envs,
        "local_sps": lo,
        "remote_sps": re,
        "ratio": re / lo,
        "colocated_sps": co,
        "colocated_ratio": co / lo,
        "colocated_busy_poll_sps": polled,
        "colocated_busy_poll_ratio": polled / lo,
        "colocated_one_core_sps": one_core_sps,
        "colocated_one_core_ratio": one_core_sps / lo,
        **double_rows,
    }


async def bench_latency(
    address: str,
    env_id: str,
    count: int,
    *,
    colocated: bool = False,
    busy_poll_us: int = 0,
    cpu: int | None = None,
) -> dict[str, float]:
    """Round-trip time of single-env steps, in microseconds (stepped on `cpu` when given)."""
    pin = pinned_thread(cpu) if cpu is not None else contextlib.nullcontext()
    with pin:
        return await _latency(address, env_id, count, colocated, busy_poll_us)


async def _latency(
    address: str, env_id: str, count: int, colocated: bool, busy_poll_us: int
) -> dict[str, float]:
    async with await _open(address, env_id, 1, colocated, busy_poll_us) as session:
        actions = _actions(1)
        times = []
        for k in range(count + 50):
            started = time.perf_counter()
            await session.step(actions[k % len(actions)])
            times.append(time.perf_counter() - started)
    us = np.array(times[50:]) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


def start_server(
    port: int, busy_poll_us: int = 0, cpu: int | None = None
) -> subprocess.Popen[bytes]:
    """An env server process; with `cpu`, pinned there once serving (services/placement.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLFLEET_LOG_LEVEL": "WARNING"}
    env["RLFLEET_ENV_SERVER__COLOCATED_BUSY_POLL_US"] = str(busy_poll_us)
    if cpu is not None:
        env["RLFLEET_CPUS"] = str(cpu)
    cmd = [sys.executable, "-m", "launch.cli", "serve", "env_server", "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout_s=30)
    except BaseException:
        server.kill()
        raise
    return server


def start_echo(port: int) -> subprocess.Popen[bytes]:
    """bench/transport/grpc_echo.py's server (ready once a channel to it is: round_trip_us
    waits)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.transport.grpc_echo", "serve", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def run_facts(load_before: tuple[float, ...], packages: tuple[str, ...]) -> dict[str, Any]:
    """Where and when the numbers were taken (also bench/game/actor_throughput.py's)."""
    versions = {n: metadata.version(n) for n in packages}
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            # other work on the machine skews both sides; interleaved rounds keep it fair-ish
            "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
            "niceness": os.nice(0),  # < 0 when run with `nice -n -N` to shield it from that load
        },
        "versions": versions | {"python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_result(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(results_json(result))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--seconds", type=float, default=4.0, help="per side and env count")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds per side")
    parser.add_argument("--latency-steps", type=int, default=2000)
    parser.add_argument(
        "--busy-poll-us", type=int, default=5000, help="both ends of the busy-polled column"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    ports = [free_port() for _ in range(4)]
    port, poll_port, one_core_port, echo_port = ports
    servers = [
        start_server(port),
        start_server(poll_port, args.busy_poll_us),
        start_server(one_core_port, cpu=one_core_cpu()),
    ]
    echo = start_echo(echo_port)
    addresses = (f"127.0.0.1:{port}", f"127.0.0.1:{poll_port}", f"127.0.0.1:{one_core_port}")
    rows: list[dict[str, Any]] = []
    try:
        for n in args.envs:
            row = compare(addresses, args.env_id, n, args.seconds, args.rounds, args.busy_poll_us)
            rows.append(asyncio.run(row))
            asyncio.run(grpc_ceiling(f"127.0.0.1:{echo_port}", args.env_id, rows[-1]))
        latencies = {
            name: asyncio.run(
                bench_latency(address, args.env_id, args.latency_steps, **how)  # type: ignore[arg-type]
            )
            for name, address, how in (
                ("gRPC", addresses[0], {}),
                ("co-located", addresses[0], {"colocated": True}),
                ("co-located one core", addresses[2], {"colocated": True, "cpu": one_core_cpu()}),
                (
                    "co-located busy-poll",
                    addresses[1],
                    {"colocated": True, "busy_poll_us": args.busy_poll_us},
                ),
            )
        }
    finally:
        for process in (*servers, echo):
            process.terminate()
            process.wait(timeout=30)

    print_table(args.env_id, rows, latencies, args.busy_poll_us)
    row_64 = next((r for r in rows if r["num_envs"] == 64), {})
    result = {
        "benchmark": "env_throughput",
        "env_id": args.env_id,
        "seconds_per_side": args.seconds,
        "rounds": args.rounds,
        "colocated_busy_poll_us": args.busy_poll_us,
        "rows": rows,
        "latency_single_env": latencies["gRPC"],
        "latency_single_env_colocated": latencies["co-located"],
        "latency_single_env_colocated_busy_poll": latencies["co-located busy-poll"],
        "latency_single_env_colocated_one_core": latencies["co-located one core"],
        "target_ratio_at_64": TARGET_AT_64,
        "ratio_at_64": row_64.get("ratio"),
        "grpc_ceiling_ratio_at_64": row_64.get("grpc_ceiling_ratio"),
        "target_colocated_ratio_at_64": COLOCATED_TARGET_AT_64,
        "colocated_ratio_at_64": row_64.get("colocated_ratio"),
        "colocated_one_core_ratio_at_64": row_64.get("colocated_one_core_ratio"),
        "colocated_busy_poll_ratio_at_64": row_64.get("colocated_busy_poll_ratio"),
        "double_buffer_ratio_at_64": row_64.get("double_buffer_ratio"),
        "colocated_double_buffer_ratio_at_64": row_64.get("colocated_double_buffer_ratio"),
        **run_facts(load_before, ("gymnasium", "grpcio", "protobuf", "numpy")),
    }
    write_result(args.out, result)
    return 0


def print_table(
    env_id: str, rows: list[dict[str, Any]], latencies: dict[str, dict[str, float]], poll_us: int
) -> None:
    print(f"{env_id}: steps/s, one Session stream vs in-process SyncVectorEnv (SAME_STEP)")
    print(
        f"{'envs':>6} {'in-process':>12} {'gRPC':>12} {'ratio':>7} {'ceiling':>8} "
        f"{'co-located':>12} {'ratio':>7} {'one core':>12} {'ratio':>7} "
        f"{'busy-poll':>12} {'ratio':>7} "
        f"{'gRPC x2':>12} {'ratio':>7} {'co-loc. x2':>12} {'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['num_envs']:>6} {r['local_sps']:>12,.0f} {r['remote_sps']:>12,.0f} "
            f"{r['ratio']:>7.2f} {r['grpc_ceiling_ratio']:>8.2f} {r['colocated_sps']:>12,.0f} "
            f"{r['colocated_ratio']:>7.2f} {r['colocated_one_core_sps']:>12,.0f} "
            f"{r['colocated_one_core_ratio']:>7.2f} {r['colocated_busy_poll_sps']:>12,.0f} "
            f"{r['colocated_busy_poll_ratio']:>7.2f} "
            + " ".join(
                f"{r[f'{k}_sps']:>12,.0f} {r[f'{k}_ratio']:>7.2f}" if f"{k}_sps" in r else ""
                for k in ("double_buffer", "colocated_double_buffer")
            )
        )
    print(
        "ceiling: in-process step time / (that + a bare gRPC echo of the step's message sizes, "
        f"bench/transport/grpc_echo.py), the best a lock-step gRPC stream could do here; one core: "
        "co-located, the server and this process's stepping thread on one CPU; busy-poll: "
        f"co-located with colocated_busy_poll_us={poll_us} on both ends; x2: double-buffered, "
        "two streams of half the envs each, one stepping while the other's answer is handled"
    )
    for name, lat in latencies.items():
        p50, p99 = lat["p50_us"], lat["p99_us"]
        print(f"single-env step round trip, {name}: p50 {p50:.0f} us, p99 {p99:.0f} us")
    row_64 = next((r for r in rows if r["num_envs"] == 64), None)
    if row_64 is None:
        return
    for name, key, target in (
        ("gRPC", "ratio", TARGET_AT_64),
        ("co-located", "colocated_ratio", COLOCATED_TARGET_AT_64),
        ("co-located on one core", "colocated_one_core_ratio", COLOCATED_TARGET_AT_64),
        ("co-located busy-poll", "colocated_busy_poll_ratio", COLOCATED_TARGET_AT_64),
        ("gRPC double-buffered", "double_buffer_ratio", TARGET_AT_64),
        ("co-located double-buffered", "colocated_double_buffer_ratio", COLOCATED_TARGET_AT_64),
    ):
        got = row_64[key]
        verdict = "meets" if got >= target else "MISSES"
        print(f"target {name} >= {target}x in-process at 64 envs: {verdict} ({got:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
