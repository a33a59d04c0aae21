"""Game actor sampling throughput: lock-step versus double-buffered, over gRPC and co-located.

What the actor's hot loop does, policy included: a TorchBehaviour (the shared actor-critic,
random weights, one torch thread as under the launcher) acts on the observations, the Rollout
records every step and each full fragment is built (bootstrap values, message encoding) but not
published. The env server is its own process (`python -m launch.cli serve env_server`), so
double buffering can overlap its stepping with the policy's forward. A third column is the
single-process loop the fleet competes with: in-process SyncVectorEnv plus the same policy.

    python -m bench.game.actor_throughput      # CartPole-v1 at 16, 64, 256 envs
    python -m bench.game.actor_throughput --envs 64 --seconds 8 --hidden 256 256

Sides alternate in short rounds (the machine is shared and noisy); the table shows medians.
Prints a table and writes bench/results/actor_throughput.json; `double_buffer_ratio_at_64` is
double-buffered over lock-step actor steps/s at 64 envs co-located (the default on one host),
`double_buffer_grpc_ratio_at_64` the same over gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import env_server.envs  # noqa: F401  (registers Snake-v0 and the Atari ids for the local side)
from bench._shared.results import RESULTS_DIR
from bench.transport.env_throughput import run_facts, start_server, write_result
from common.behaviour import TorchBehaviour
from common.policy_config import PolicyConfig
from sampler.actors.envs import EnvGroup, TickEvents
from sampler.actors.rollout import FragmentMeta, Rollout
from sampler.actors.sampling import DoubleBuffer, fill_lock_step
from services.ports import free_port

RESULTS = RESULTS_DIR / "actor_throughput.json"
SIDES = ("grpc/lock", "grpc/double", "shm/lock", "shm/double")


class ActorSide:
    """One EnvGroup (gRPC or co-located, lock-step or double-buffered) with its own policy."""

    def __init__(self, args: argparse.Namespace, address: str, num_envs: int, side: str) -> None:
        transport, mode = side.split("/")
        self.envs = EnvGroup(
            [address],
            num_envs,
            args.env_id,
            seed=0,
            colocated="auto" if transport == "shm" else "off",
            double_buffer=mode == "double",
        )
        self.args, self.transport, self.num_envs = args, transport, num_envs

    async def open(self) -> None:
        first = await self.envs.open()
        assert first is not None
        if self.envs.transports.split(",")[0] != self.transport:
            raise RuntimeError(f"wanted {self.transport} steps, got {self.envs.transports}")
        envs, config = self.envs, PolicyConfig(hidden_sizes=tuple(self.args.hidden))
        self.policy = TorchBehaviour(envs.observation_space, envs.action_space, config, seed=0)
        self.rollout = Rollout(
            self.args.rollout_length,
            self.num_envs,
            envs.observation_space,
            envs.action_space,
            has_values=True,
            parts=envs.parts,
        )
        self.rollout.begin(first)
        self.meta = FragmentMeta("bench", "actor", "0", self.args.env_id, envs.addresses, "")
        if len(envs.parts) > 1:
            self.fill = DoubleBuffer([self.policy] * 2, self.rollout, envs).fill
        else:
            self.fill = lambda account: fill_lock_step(self.policy, self.rollout, envs, account)

    async def measure(self, seconds: float) -> float:
        """Actor env steps/s over whole fragments, for about `seconds`."""
        steps = 0

        async def account(events: TickEvents, count: int) -> bool:
            nonlocal steps
            steps += count
            return False

        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            await self.fill(account)
            self.rollout.build(self.policy, self.meta)
            self.rollout.restart()
        return steps / elapsed


class LocalSide:
    """Single process: SyncVectorEnv (SAME_STEP, as the server) and the same policy per tick."""

    def __init__(self, args: argparse.Namespace, num_envs: int) -> None:
        self.envs = gym.vector.SyncVectorEnv(
            [lambda: gym.make(args.env_id)] * num_envs,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        self.obs, _ = self.envs.reset(seed=0)
        config = PolicyConfig(hidden_sizes=tuple(args.hidden))
        space = self.envs.single_observation_space, self.envs.single_action_space
        self.policy = TorchBehaviour(*space, config, seed=0)
        self.num_envs = num_envs

    def measure(self, seconds: float) -> float:
        steps, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            for _ in range(20):
                decision = self.policy.act(self.obs)
                self.obs, *_ = self.envs.step(decision.env_actions)
                steps += self.num_envs
        return steps / elapsed


async def compare(args: argparse.Namespace, address: str, num_envs: int) -> dict[str, Any]:
    sides = {side: ActorSide(args, address, num_envs, side) for side in SIDES}
    local = LocalSide(args, num_envs)
    samples: dict[str, list[float]] = {side: [] for side in (*SIDES, "local")}
    try:
        for side in sides.values():
            await side.open()
            await side.measure(0.3)  # warm up
        local.measure(0.3)
        share = args.seconds / args.rounds
        for _ in range(args.rounds):
            samples["local"].append(local.measure(share))
            for name, side in sides.items():
                samples[name].append(await side.measure(share))
    finally:
        for side in sides.values():
            await side.envs.close()
        local.envs.close()
    sps = {name: float(np.median(values)) for name, values in samples.items()}
    return {
        "num_envs": num_envs,
        "sps": sps,
        "double_ratio_grpc": sps["grpc/double"] / sps["grpc/lock"],
        "double_ratio_shm": sps["shm/double"] / sps["shm/lock"],
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--envs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--rollout-length", type=int, default=64, help="T, steps per fragment")
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 64], help="MLP sizes")
    parser.add_argument("--seconds", type=float, default=8.0, help="per side and env count")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds per side")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as each actor under the launcher (OMP_NUM_THREADS=1)

    load_before = os.getloadavg()
    port = free_port()
    server = start_server(port)
    rows: list[dict[str, Any]] = []
    try:
        for n in args.envs:
            rows.append(asyncio.run(compare(args, f"127.0.0.1:{port}", n)))
    finally:
        server.terminate()
        server.wait(timeout=30)

    print(f"{args.env_id}: actor env steps/s with the policy (hidden_sizes {args.hidden}, a "
          f"Nature-CNN trunk for images), T={args.rollout_length}, medians of {args.rounds} "
          "rounds")  # fmt: skip
    head = "".join(f"{name:>13}" for name in (*SIDES, "local"))
    print(f"{'envs':>6}{head}{'x gRPC':>9}{'x shm':>8}")
    for r in rows:
        cells = "".join(f"{r['sps'][name]:>13,.0f}" for name in (*SIDES, "local"))
        ratios = f"{r['double_ratio_grpc']:>9.2f}{r['double_ratio_shm']:>8.2f}"
        print(f"{r['num_envs']:>6}{cells}{ratios}")
    print("x gRPC, x shm: double-buffered over lock-step steps/s on that transport")
    row_64 = next((r for r in rows if r["num_envs"] == 64), None)
    result = {
        "benchmark": "actor_throughput",
        "env_id": args.env_id,
        "rollout_length": args.rollout_length,
        "hidden_sizes": args.hidden,
        "seconds_per_side": args.seconds,
        "rounds": args.rounds,
        "rows": rows,
        "double_buffer_ratio_at_64": row_64["double_ratio_shm"] if row_64 else None,
        "double_buffer_grpc_ratio_at_64": row_64["double_ratio_grpc"] if row_64 else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **run_facts(load_before, ("gymnasium", "grpcio", "numpy", "torch")),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
