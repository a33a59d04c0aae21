"""The ``appo`` job through the fleet: `rlfleet up` on (a copy of) examples/cartpole_appo.yaml, the
real processes (embedded nats-server, env-0, the DeepSpeed learner, actor-0 and actor-1), with a
modest target return so it stays short. The learner trains on V-trace (its metrics report the
importance ratios), applies every fragment once, and the run ends by reaching the target.

Also: the game learner's engine (learner.game.workload.build_game_engine: learner.game clips the
gradients instead of DeepSpeed, AdamW's foreach step) trains to the same weights, bit for bit, as
the plain DeepSpeed engine."""

from __future__ import annotations

import collections
import json
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.fixtures.launch import Up, assert_nothing_left

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cartpole_appo.yaml"
SERVICES = ("env-0", "learner", "actor-0", "actor-1")
TARGET = 150.0  # modest: CartPole's random policy scores ~20; the example reaches 475
RUN_TIMEOUT_S = 240.0  # ~20-60 s on 2 cores; a loaded machine is slower, not a failure

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="scans /proc"),
]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_appo_reaches_a_modest_cartpole_return_through_the_fleet(tmp_path: Path) -> None:
    config = yaml.safe_load(EXAMPLE.read_text())
    assert config["job"]["kind"] == "appo"
    run_dir = tmp_path / "run"
    config["run"] = {"name": f"itest-appo-{uuid.uuid4().hex[:8]}", "dir": str(run_dir)}
    config["job"].update(target_return=TARGET, total_timesteps=60_000, checkpoint_every=5)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    up = Up(path, run_dir, services=SERVICES, budget_s=RUN_TIMEOUT_S)
    try:
        assert up.wait() == 0, "the run failed"
        log = (run_dir / "logs" / "learner.log").read_text()
        assert f"reached target_return {TARGET:g}" in log, "the run ended without the target"
        assert "losses/vtrace_rho_mean=" in log, "the learner did not train on V-trace"
        entries = [json.loads(line) for line in (run_dir / "learner" / "applied.jsonl").open()]
        applied = [e for e in entries if e["status"] == "applied"]
        twice = [i for i, n in collections.Counter(e["id"] for e in applied).items() if n > 1]
        assert applied and not twice, f"fragments applied more than once: {twice}"
        assert all(0 <= e["lag"] <= config["job"]["max_policy_lag"] for e in applied)
        assert {e["id"].split("/")[1] for e in applied} == {"actor-0", "actor-1"}
        assert (run_dir / "final" / "policy.pt").is_file()
    except BaseException:
        print(up.diagnostics())
        raise
    finally:
        up.stop()
    assert_nothing_left(run_dir)


@pytest.mark.parametrize("algo", ["ppo", "appo"])
def test_the_learners_own_clipping_gives_deepspeeds_weights_bit_for_bit(algo: str) -> None:
    # GameWorkload's engine (no DeepSpeed clipping: learner.game clips; AdamW's foreach step)
    # against the plain DeepSpeed one: same seed, same batches, same minibatch order.
    import gymnasium as gym
    import torch

    from bench.game.ppo_update_profile import fragments
    from common.policies import build_policy
    from learner.consumer import seed_everything
    from learner.engine import build_engine
    from learner.game.settings import LearnerSettings
    from learner.game.update import FragmentBatch, decode_fragment, update
    from learner.game.workload import build_game_engine
    from rlfleet.bus.v1 import trajectory_pb2

    s = LearnerSettings(algo=algo, device="cpu", fragments_per_update=2, minibatch_size=64,
                        update_epochs=2, max_grad_norm=0.05)  # fmt: skip  # small: clips often
    env = gym.make(s.env_id)
    weights, engines = [], []
    try:
        for ours in (False, True):
            seed_everything(s.seed)
            policy = build_policy(env.observation_space, env.action_space, s.policy)
            policy.forward = policy.evaluate  # type: ignore[method-assign]
            engine = (build_game_engine(policy, s) if ours
                      else build_engine(policy, s.optimizer(), s.deepspeed()))  # fmt: skip
            engines.append(engine)
            pool = fragments(s, engine.module, 2, 16, 4)
            generator = torch.Generator().manual_seed(s.seed)
            for _ in range(3):
                items = [decode_fragment(trajectory_pb2.RolloutFragment.FromString(raw))
                         for raw in pool]  # fmt: skip
                update(engine, FragmentBatch(items), s, lr=1e-2, generator=generator,
                       clip_grad=ours)  # fmt: skip
            weights.append(engine.named_weights(torch.float32))
    finally:
        env.close()
        for engine in engines:
            engine.close()
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
