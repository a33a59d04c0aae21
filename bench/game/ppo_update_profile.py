"""Where one game-learner update's time goes, phase by phase, in one process (no bus, no actors).

The learner of a run file's job (``examples/cartpole_ppo.yaml`` by default: its LearnerSettings
through the job's own expansion, the DeepSpeed engine ``rlfleet up`` builds) is fed the same
CartPole fragments, encoded as ``bus.v1.RolloutFragment`` bytes, for ``--updates`` updates.
Per update it times what the learner loop does (learner.loop, learner.game):

- ``decode``: parse the messages and ``decode_fragment`` them;
- ``prepare``: the critic's values (and, for V-trace, the policy's log-probs) and the advantages;
- ``forward`` / ``backward`` / ``step``: the DeepSpeed engine's calls, summed over minibatches;
- ``losses``: the rest of ``update`` (losses, metrics, minibatch indexing, and the gradient
  clipping when ``learner.game`` clips instead of DeepSpeed's ``step``);
- ``publish``: ``named_weights`` + ``WeightStore.publish`` (what actors fetch);
- ``ledger``: the applied lines of ``applied.jsonl``;
- ``checkpoint``: ``Engine.save`` every ``checkpoint_every`` updates, per update amortised.

The ack of the checkpointed messages is one NATS call per checkpoint and is not timed here.

    python -m bench.game.ppo_update_profile [--config examples/cartpole_ppo.yaml] [--updates 40]

Writes ``bench/results/ppo_update_profile.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bench._shared.results import RESULTS_DIR, ROOT, results_json
from common import tensor
from common.policies import build_policy
from learner.consumer import Ledger, seed_everything
from learner.engine import build_engine
from learner.game import update as game
from learner.game.settings import LearnerSettings
from learner.game.workload import build_game_engine
from learner.weights import WeightStore
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.common.v1 import tensor_pb2
from services.config import load_run_config

EXAMPLE = ROOT / "examples" / "cartpole_ppo.yaml"
PHASES = ("decode", "prepare", "forward", "backward", "step", "losses", "publish", "ledger",
          "checkpoint")  # fmt: skip


def learner_settings(config: Path) -> LearnerSettings:
    """The learner's settings as the run file's job expands them (device forced to cpu)."""
    run = load_run_config(config, environ={})
    learner = run.service("learner").settings.model_dump()
    learner.update(env_servers=[], device="cpu")
    return LearnerSettings.model_validate(learner)


def _tree(array: np.ndarray) -> tensor_pb2.TensorTree:
    return tensor_pb2.TensorTree(tensor=tensor.encode(array))


def fragments(s: LearnerSettings, policy: Any, count: int, T: int, N: int) -> list[bytes]:
    """``count`` encoded fragments of T steps of N CartPole envs sampled by ``policy``."""
    import gymnasium as gym

    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(s.env_id) for _ in range(N)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    obs, _ = envs.reset(seed=s.seed)
    out = []
    for i in range(count):
        b: dict[str, list[Any]] = defaultdict(list)
        finals, final_obs = [], []
        for t in range(T):
            with torch.no_grad():
                action, logp, _, _ = policy.evaluate(torch.as_tensor(obs, dtype=torch.float32))
            nxt, reward, term, trunc, info = envs.step(action.numpy())
            b["obs"].append(obs)
            b["actions"].append(action.numpy())
            b["logprobs"].append(logp.numpy())
            b["rewards"].append(reward.astype(np.float32))
            b["terminated"].append(term)
            b["truncated"].append(trunc)
            for n in np.flatnonzero(trunc & ~term):
                finals.append(t * N + n)
                final_obs.append(info["final_obs"][n])
            obs = nxt
        msg = trajectory_pb2.RolloutFragment(
            fragment_id=f"profile/{i}",
            actor_id="profile",
            num_steps=T,
            num_envs=N,
            observations=_tree(np.stack(b["obs"]).astype(np.float32)),
            actions=_tree(np.stack(b["actions"])),
            logprobs=tensor.encode(np.stack(b["logprobs"])),
            rewards=tensor.encode(np.stack(b["rewards"])),
            terminated=tensor.encode(np.stack(b["terminated"])),
            truncated=tensor.encode(np.stack(b["truncated"])),
            next_observations=_tree(obs.astype(np.float32)),
        )
        if finals:
            msg.final_indices.CopyFrom(tensor.encode(np.array(finals, dtype=np.int64)))
            msg.final_observations.CopyFrom(_tree(np.stack(final_obs).astype(np.float32)))
        out.append(msg.SerializeToString())
    envs.close()
    return out


class TimedEngine:
    """The engine, its forward/backward/step timed into ``times``."""

    def __init__(self, engine: Any, times: dict[str, float]) -> None:
        self._engine, self._times = engine, times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _timed(self, phase: str, fn: Any, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._times[phase] += time.perf_counter() - started

    def __call__(self, *args: Any) -> Any:
        return self._timed("forward", self._engine, *args)

    def backward(self, loss: torch.Tensor) -> None:
        self._timed("backward", self._engine.backward, loss)

    def step(self) -> None:
        self._timed("step", self._engine.step)


@contextlib.contextmanager
def timed_prepare(times: dict[str, float]) -> Iterator[None]:
    original = game.prepare

    def prepare(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times["prepare"] += time.perf_counter() - started

    game.prepare = prepare  # type: ignore[assignment]
    try:
        yield
    finally:
        game.prepare = original  # type: ignore[assignment]


class Variant:
    """One learner engine of the profile and its phase times. Three engines, each removing one
    more cost: DeepSpeed clipping the gradients and making every call (the engine before
    ``engine_settings``); ``learner.game.update`` clipping them; and the engine's ``direct``
    calls (``learner.engine.Engine``: module, ``loss.backward()`` and optimizer without
    DeepSpeed's wrappers), what the learner runs."""

    def __init__(self, s: LearnerSettings, work: Path, name: str) -> None:
        import gymnasium as gym

        self.s, self.work, self.name = s, work, name
        self.clip_grad = name != "deepspeed"
        seed_everything(s.seed)  # as the learner: the same initial weights in every variant
        env = gym.make(s.env_id)
        policy = build_policy(env.observation_space, env.action_space, s.policy)
        env.close()
        policy.forward = policy.evaluate  # type: ignore[method-assign]  # as GameWorkload.build
        if name == "deepspeed":
            self.engine = build_engine(policy, s.optimizer(), s.deepspeed())
        else:
            self.engine = build_game_engine(policy, s)
        self.engine.direct = name == "direct"
        self.store = WeightStore("profile", keep=s.keep_versions)
        self.ledger = Ledger(work / "applied.jsonl")
        self.generator = torch.Generator().manual_seed(s.seed)
        self.times: dict[str, list[float]] = defaultdict(list)  # phase -> seconds per update

    def update(self, u: int, pool: list[bytes]) -> None:
        s, engine = self.s, self.engine
        inner: dict[str, float] = defaultdict(float)
        timed = TimedEngine(engine, inner)
        t0 = time.perf_counter()
        items = [game.decode_fragment(trajectory_pb2.RolloutFragment.FromString(r)) for r in pool]
        t1 = time.perf_counter()
        with timed_prepare(inner):
            batch = game.FragmentBatch(items)
            game.update(timed, batch, s, lr=s.learning_rate, generator=self.generator,  # type: ignore[arg-type]
                        clip_grad=self.clip_grad)  # fmt: skip
        t2 = time.perf_counter()
        self.store.publish(engine.named_weights())
        t3 = time.perf_counter()
        for f in items:
            self.ledger.write(id=f.fragment_id, status="applied", update=u, version=u - 1)
        t4 = time.perf_counter()
        if u % s.checkpoint_every == 0:
            engine.save(self.work / "checkpoints", f"update-{u:08d}", {"updates": u},
                        keep=s.keep_checkpoints)  # fmt: skip
        t5 = time.perf_counter()
        inner["losses"] = (t2 - t1) - sum(inner.values())
        phases = {**inner, "decode": t1 - t0, "publish": t3 - t2, "ledger": t4 - t3,
                  "checkpoint": t5 - t4}  # fmt: skip
        for phase in PHASES:
            self.times[phase].append(phases.get(phase, 0.0))

    def close(self) -> str:
        """The sha256 of the weights now; closes the engine."""
        try:
            weights = self.engine.named_weights(torch.float32)
            return hashlib.sha256(
                b"".join(w.numpy().tobytes() for w in weights.values())
            ).hexdigest()
        finally:
            self.ledger.close()
            self.engine.close()


VARIANTS = {
    "deepspeed": "DeepSpeed clips and makes every call",
    "learner_clips": "learner.game clips, DeepSpeed's calls",
    "direct": "learner.game clips, the engine's direct calls (what the learner runs)",
}


def profile(config: Path, updates: int, work: Path) -> dict[str, Any]:
    """Median milliseconds per update of each phase for each of ``VARIANTS``: all engines in
    this process, updates alternated between them, so background load hits them alike; the
    same initial weights, batches and minibatch order, so their weights must come out
    bit-identical."""
    s = learner_settings(config)
    job = yaml.safe_load(config.read_text())["job"]
    T, N = int(job.get("rollout_length", 128)), int(job.get("num_envs", 8))
    variants = [Variant(s, work / name, name) for name in VARIANTS]
    pool = fragments(s, variants[0].engine.module, s.fragments_per_update, T, N)
    try:
        for u in range(1, updates + 1):
            for v in variants if u % 2 else reversed(variants):
                v.update(u, pool)
    finally:
        digests = [v.close() for v in variants]
    batch = T * N * s.fragments_per_update
    result: dict[str, Any] = {
        "config": str(config),
        "algo": s.algo,
        "updates": updates,
        "minibatches_per_update": s.update_epochs * -(-batch // s.minibatch_size),
        "checkpoint_every": s.checkpoint_every,
        "bit_identical_weights": len(set(digests)) == 1,
    }
    for v in variants:
        ms = {k: 1000 * statistics.median(v.times[k]) for k in PHASES}
        ms["checkpoint"] = 1000 * statistics.mean(v.times["checkpoint"])  # every 10th: amortised
        result[v.name] = {"variant": VARIANTS[v.name], "ms_per_update": ms,
                          "total_ms": sum(ms.values())}  # fmt: skip
    return result


def print_profile(result: dict[str, Any]) -> None:
    print(f"{result['algo']} update, {result['minibatches_per_update']} minibatches: median ms "
          f"per update")  # fmt: skip
    for name, what in VARIANTS.items():
        print(f"  {name:<14} {what}")
    print(f"  {'phase':<11}" + "".join(f"{name:>15}" for name in VARIANTS))
    for phase in PHASES:
        row = "".join(f"{result[name]['ms_per_update'][phase]:15.2f}" for name in VARIANTS)
        print(f"  {phase:<11}{row}")
    first = result["deepspeed"]["total_ms"]
    row = "".join(f"{result[n]['total_ms']:9.2f} ({result[n]['total_ms'] / first:.2f}x)"
                  for n in VARIANTS)  # fmt: skip
    print(f"  {'total':<11}{row}")
    print(f"  weights bit-identical after {result['updates']} updates: "
          f"{result['bit_identical_weights']}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=EXAMPLE)
    parser.add_argument("--updates", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rlfleet-profile-") as tmp:
        result = profile(args.config, args.updates, Path(tmp))
    out = RESULTS_DIR / "ppo_update_profile.json"
    out.write_text(results_json(result))
    print_profile(result)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if result["bit_identical_weights"] else 1


if __name__ == "__main__":
    sys.exit(main())
