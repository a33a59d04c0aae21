"""learner.ranks: rank 0's batch reaches rank 1 bit for bit, and two data-parallel ranks (real
DeepSpeed over gloo, two processes) train it to the weights one rank reaches on the whole batch,
identical on both ranks. Run as a script, this file is one rank (or the single-rank reference).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from learner.game.settings import LearnerSettings  # noqa: E402
from learner.ranks import Ranks  # noqa: E402
from learner.workload import Progress  # noqa: E402
from services.errors import InvalidArgument  # noqa: E402

# 2 fragments of 25 steps x 2 envs = 100 rows in minibatches of 33: the shards are uneven
# (17/16) and the last minibatch (1 row) leaves rank 1 without rows.
STEPS, ENVS, FRAGMENTS = 25, 2, 2
STALL_TIMEOUT_S = 3.0
SETTINGS = {
    "device": "cpu",
    "minibatch_size": 33,
    "update_epochs": 2,
    "target_kl": 10.0,  # never reached, but its test is a collective: exercised
    "learning_rate": 1e-3,
}


def _fragments() -> list[object]:
    from learner.game.update import decode_fragment
    from tests.unit.test_learner_game import make_fragment

    rng = np.random.default_rng(7)
    items: list[object] = []
    for i in range(FRAGMENTS):
        terminated = rng.random((STEPS, ENVS)) < 0.1
        rewards = rng.normal(size=(STEPS, ENVS)).astype(np.float32)
        msg = make_fragment(rewards, terminated=terminated, fragment_id=f"f{i}", seed=i)
        items.append(decode_fragment(msg, (4,), ()))
    return items


def _train(items: list[object], generator: torch.Generator, out: Path, rank: int) -> None:
    """Build the policy (same seed everywhere) on an engine, one update, weights to ``out``;
    with 2 ranks also a checkpoint round trip."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    import gymnasium as gym

    from common.policies import PolicyConfig, build_policy
    from learner.engine import build_engine
    from learner.game.update import FragmentBatch, update

    # The pair runs ZeRO-1 (each rank checkpoints its optimizer shard), the reference ZeRO-0.
    cfg = LearnerSettings.model_validate({**SETTINGS, "zero_stage": int(world > 1)})
    torch.manual_seed(3)
    policy = build_policy(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2), PolicyConfig())
    policy.forward = policy.evaluate  # type: ignore[method-assign]
    with build_engine(policy, cfg.optimizer(), cfg.deepspeed()) as engine:
        ranks = Ranks(rank, engine.world_size, timeout_s=60.0)
        if engine.world_size > 1:
            ranks.connect()
            if rank == 0:
                asyncio.run(ranks.send_train(items, Progress(samples=7), generator))
            else:
                _, items, progress, rng = ranks.receive()
                assert progress.samples == 7
                generator = torch.Generator().manual_seed(0)
                generator.set_state(rng)
        torch.save(items, out / f"items-{rank}.pt")
        torch.save(engine.named_weights(torch.float32), out / f"init-{rank}.pt")
        batch = FragmentBatch(items)  # type: ignore[arg-type]
        update(engine, batch, cfg, lr=1e-3, generator=generator)
        torch.save(engine.named_weights(torch.float32), out / f"weights-{rank}.pt")
        if engine.world_size == 1:
            return
        # A collective checkpoint (as learner.ranks saves it: rank 0's client state only), then
        # a second update twice: straight on, and again after loading the checkpoint.
        engine.save(out / "ckpt", "one", {"from": "rank 0"} if rank == 0 else {})
        shuffle = generator.get_state()
        update(engine, batch, cfg, lr=1e-3, generator=generator)
        straight = engine.named_weights(torch.float32)
        restored = engine.load(out / "ckpt") or {}
        assert restored.get("from") == "rank 0", restored.keys()  # every rank reads rank 0's
        update(engine, batch, cfg, lr=1e-3, generator=generator.set_state(shuffle))
        again = engine.named_weights(torch.float32)
        assert all(torch.equal(straight[n], again[n]) for n in straight), "restore differs"


def _run_rank(out: Path) -> None:
    rank = int(os.environ.get("RANK", "0"))
    items = _fragments() if rank == 0 else []
    _train(items, torch.Generator().manual_seed(11), out, rank)


def _stall(out: Path) -> None:
    """Rank 0 sends one order, then stalls; rank 1 must give up after ``timeout_s``."""
    import datetime
    import time

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ranks = Ranks(rank, 2, timeout_s=STALL_TIMEOUT_S)
    ranks.connect()
    if rank == 0:
        asyncio.run(ranks.send("wait"))
        time.sleep(120)  # a rank 0 that hangs (the test kills it)
        return
    assert ranks.receive() == ("wait",)
    started = time.monotonic()
    try:
        ranks.receive()
    except RuntimeError as exc:
        (out / "gave-up").write_text(f"{time.monotonic() - started:.2f}\n{exc}")
    # As the learner's Engine.close does: a group left for interpreter exit to tear down after a
    # timed-out collective aborts the process now and then ("terminate called without an
    # active exception").
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(
    out: Path, world: int, rank: int, port: int, role: str = "train"
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if world > 1:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    return subprocess.Popen([sys.executable, __file__, str(out), role], env=env, cwd=REPO)


@pytest.mark.slow
def test_two_ranks_get_the_batch_bit_exactly_and_train_like_one(tmp_path: Path) -> None:
    single, pair = tmp_path / "single", tmp_path / "pair"
    single.mkdir()
    pair.mkdir()
    port = _free_port()
    procs = [_spawn(pair, 2, 0, port), _spawn(pair, 2, 1, port), _spawn(single, 1, 0, 0)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0]

    sent, received = (torch.load(pair / f"items-{r}.pt", weights_only=False) for r in (0, 1))
    assert len(received) == FRAGMENTS
    for a, b in zip(sent, received, strict=True):
        for name, value in vars(a).items():
            other = vars(b)[name]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), name
            else:
                assert value == other, name

    w0, w1, ref = (
        torch.load(d / f"weights-{r}.pt") for d, r in ((pair, 0), (pair, 1), (single, 0))
    )
    for name in ref:
        assert torch.equal(w0[name], w1[name]), f"ranks differ on {name}"
        assert torch.allclose(w0[name], ref[name], atol=1e-5, rtol=0), f"{name} is not one rank's"
    init = torch.load(single / "init-0.pt")
    assert max(float((ref[n] - init[n]).abs().max()) for n in ref) > 1e-4  # it did train


@pytest.mark.slow
def test_a_rank_gives_up_on_a_stalled_rank_0(tmp_path: Path) -> None:
    port = _free_port()
    rank0, rank1 = (_spawn(tmp_path, 2, r, port, role="stall") for r in (0, 1))
    try:
        assert rank1.wait(timeout=120) == 0
    finally:
        for p in (rank0, rank1):
            p.kill()
            p.wait()
    waited, error = (tmp_path / "gave-up").read_text().split("\n", 1)
    assert STALL_TIMEOUT_S <= float(waited) < STALL_TIMEOUT_S + 10, waited
    assert error


def test_settings_refuse_zero3_with_several_ranks() -> None:
    with pytest.raises(ValueError, match="ranks > 1 needs zero_stage 0, 1 or 2"):
        LearnerSettings.model_validate({"device": "cpu", "ranks": 2, "zero_stage": 3})


def test_ranks_must_match_the_launchers_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    settings = LearnerSettings.model_validate({"device": "cpu", "ranks": 2})
    with pytest.raises(InvalidArgument, match="ranks 2 but the launcher started WORLD_SIZE=3"):
        Ranks.start(settings)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert Ranks.start(LearnerSettings.model_validate({"device": "cpu"})) is None


if __name__ == "__main__":
    (_run_rank if sys.argv[2] == "train" else _stall)(Path(sys.argv[1]))
