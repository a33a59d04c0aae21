"""The runs of ``bench/game/ppo_cartpole.py``: each returns one dict with the same core keys.

- ``baseline``: ``bench/game/ppo_baseline.py`` in this process (one ``SyncVectorEnv`` of all envs);
- ``system``: ``rlfleet up`` on a variant of the example run file (actors, envs, env path);
- ``cleanrl`` / ``envpool``: CleanRL 1.2.0's own ``ppo.py`` (``python -m cleanrl.ppo``) and
  ``bench/game/ppo_envpool.py`` (the same loop over EnvPool's CartPole), in the comparison venv.

Core keys: ``steps`` (env steps taken), ``sps`` (steps / seconds from the first env step, the
baseline's clock), ``reached_target_at_step``, ``time_to_target_s`` (seconds from the first env
step to a mean return of 475 over the last 20 episodes), ``final_mean_return``. The system adds
``startup_s`` (launch to the first env step of any actor), ``time_to_target_from_launch_s``,
``wall_s`` and ``transport`` (the actors' env links: ``shm`` or ``grpc``, from their logs).
"""

from __future__ import annotations

import collections
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from bench._shared.results import ROOT
from bench._shared.venvs import ensure_venv
from bench.game.ppo_baseline import PPOArgs, run_baseline

TARGET = 475.0
WINDOW = 20  # episodes in the mean return, as the learner and the baseline count it
COMPARE_REQUIREMENTS = Path(__file__).with_name("requirements-compare.txt")
# Run by path in the comparison venv, without the repository on its path (it imports only
# torch, numpy and envpool), unlike every other bench module.
ENVPOOL_SCRIPT = Path(__file__).with_name("ppo_envpool.py")
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # every side: one torch thread


# --- the single-process baseline --------------------------------------------------------------


def baseline_args(job: dict[str, Any], seed: int, max_wall_s: float | None = None) -> PPOArgs:
    """The run file's hyperparameters in the baseline's terms: one env pool of all the envs."""
    batch = job["fragments_per_update"] * job["rollout_length"] * job["num_envs"]
    return PPOArgs(
        seed=seed,
        num_envs=batch // job["rollout_length"],
        rollout_length=job["rollout_length"],
        total_timesteps=job["total_timesteps"],
        learning_rate=job["learning_rate"],
        anneal_lr=job["anneal_lr"],
        gamma=job["gamma"],
        gae_lambda=job["gae_lambda"],
        num_minibatches=batch // job["minibatch_size"],
        update_epochs=job["update_epochs"],
        clip_coef=job["clip_coef"],
        clip_vloss=job["clip_vloss"],
        ent_coef=job["ent_coef"],
        target_return=TARGET,
        max_wall_s=max_wall_s,
        verbose=False,
    )


def baseline(job: dict[str, Any], seed: int, max_wall_s: float | None = None) -> dict[str, Any]:
    out = run_baseline(baseline_args(job, seed, max_wall_s))
    out.pop("args")
    out["time_to_target_s"] = out["reached_target_wall_s"]
    return out


# --- the system -------------------------------------------------------------------------------


def variant(
    config: dict[str, Any],
    actors: int,
    envs_total: int,
    *,
    colocated: str = "auto",
    total_timesteps: int | None = None,
) -> dict[str, Any]:
    """The run file with ``actors`` actors sharing ``envs_total`` envs, one fragment of each per
    update (batch = rollout_length x envs_total, as the baseline's), the env servers' co-located
    path ``auto`` or ``off`` (gRPC only); every other hyperparameter as given."""
    if envs_total % actors:
        raise ValueError(f"{envs_total} envs do not split over {actors} actors")
    config = json.loads(json.dumps(config))
    job = config["job"]
    job.update(num_actors=actors, num_envs=envs_total // actors, fragments_per_update=actors)
    if total_timesteps is not None:
        job["total_timesteps"] = total_timesteps
    if colocated != "auto":
        job["env_server"] = {**job.get("env_server", {}), "colocated": colocated}
    return config


def _scalars(tb_dir: Path, tag: str) -> list[tuple[float, int, float]]:
    """(wall time, step, value) of one TensorBoard scalar tag, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]


_ACTOR_START = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+ sampler\.actors\.actor: "
    r"actor \S+: \d+ x \S+ over \S+ \(steps via ([^,)]+(?:,[^,)]+)*)"
)


def _actor_starts(log_dir: Path) -> tuple[float | None, list[str]]:
    """The first actor's first env step (its start line) and every actor's transports."""
    first, transports = None, []
    for log in sorted(log_dir.glob("actor-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = _ACTOR_START.match(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                first = t if first is None else min(first, t)
                transports.append(m.group(2).split(",")[0].strip())
                break
    return first, transports


def system(
    config: dict[str, Any], seed: int, work: Path, label: str, timeout_s: float
) -> dict[str, Any]:
    """``rlfleet up`` until the learner reaches 475 or its budget; stopped (SIGTERM: a graceful
    stop) after ``timeout_s`` from launch, with what it logged until then."""
    name = f"bench-{label}-s{seed}"
    config = json.loads(json.dumps(config))
    config["run"] = {"name": name, "dir": str(work / name)}
    config["job"].update(seed=seed, target_return=TARGET)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.time()
    with open(work / f"{name}.out", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "up", str(path)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **THREADS_ENV},
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.time() - started
    tail = (work / f"{name}.out").read_text(errors="replace")[-3000:]
    if proc.returncode != 0 and not timed_out:
        raise RuntimeError(f"system run {name} failed ({proc.returncode}):\n{tail}")
    returns = _scalars(work / name / "tensorboard", "charts/episodic_return")
    if not returns:
        raise RuntimeError(f"no charts/episodic_return in {work / name / 'tensorboard'}:\n{tail}")
    first_step, transports = _actor_starts(work / name / "logs")
    first_update = returns[0][0]
    clock = first_step if first_step is not None else first_update
    reached = next(((t, step) for t, step, v in returns if v >= TARGET), None)
    last_time, last_step, last_value = returns[-1]
    steady = (last_step - returns[0][1]) / (last_time - first_update) if len(returns) > 1 else None
    return {
        "steps": last_step,
        "sps": last_step / max(last_time - clock, 1e-9),
        "sps_steady": steady,  # first to last update: without the first rollout and update
        "reached_target_at_step": reached[1] if reached else None,
        "time_to_target_s": (reached[0] - clock) if reached else None,
        "time_to_target_from_launch_s": (reached[0] - started) if reached else None,
        "startup_s": clock - started,
        "wall_s": wall,
        "final_mean_return": last_value,
        "transport": "+".join(sorted(set(transports))) or "unknown",
        "timed_out": timed_out,
    }


# --- CleanRL and EnvPool in their own environment ----------------------------------------------


def ensure_compare_venv(venv: Path) -> Path:
    """The comparison venv's python (``bench._shared.venvs.ensure_venv`` from the pinned lock, which
    lists every package, hence ``--no-deps``)."""
    return ensure_venv(
        venv, COMPARE_REQUIREMENTS, pip_flags=("--no-deps", "--ignore-requires-python")
    )


def compare_versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
        "('cleanrl', 'envpool', 'gym', 'gymnasium', 'torch', 'numpy')}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def cleanrl_flags(job: dict[str, Any], seed: int) -> list[str]:
    """CleanRL ppo.py's flags for the run file's hyperparameters (its own names)."""
    batch = job["fragments_per_update"] * job["rollout_length"] * job["num_envs"]
    return [
        "--env-id", job["env_id"], "--seed", str(seed),
        "--total-timesteps", str(job["total_timesteps"]),
        "--num-envs", str(batch // job["rollout_length"]),
        "--num-steps", str(job["rollout_length"]),
        "--learning-rate", str(job["learning_rate"]),
        "--anneal-lr", str(job["anneal_lr"]),
        "--gamma", str(job["gamma"]), "--gae-lambda", str(job["gae_lambda"]),
        "--num-minibatches", str(batch // job["minibatch_size"]),
        "--update-epochs", str(job["update_epochs"]),
        "--clip-coef", str(job["clip_coef"]), "--clip-vloss", str(job["clip_vloss"]),
        "--ent-coef", str(job["ent_coef"]),
    ]  # fmt: skip


_EPISODE = re.compile(r"global_step=(\d+), episodic_return=\[?([-+0-9.eE]+)")
_SPS = re.compile(r"^SPS: (\d+)")


def compare_run(
    impl: str, python: Path, job: dict[str, Any], seed: int, work: Path, timeout_s: float
) -> dict[str, Any]:
    """Run CleanRL's ppo.py (``impl="cleanrl"``) or bench/game/ppo_envpool.py (``"envpool"``) as a
    program, reading its printed lines as they come; stopped once the mean of its last 20
    printed episodic returns reaches 475 (neither stops by itself) or after ``timeout_s``.
    Its clock starts where its own SPS counts from (after env and network set-up), estimated
    from the first ``SPS:`` line: that line's time minus one batch at that rate."""
    flags = cleanrl_flags(job, seed)
    if impl == "cleanrl":
        cmd = [str(python), "-m", "cleanrl.ppo", *flags, "--cuda", "False"]
    else:
        cmd = [str(python), str(ENVPOOL_SCRIPT), *flags]
    batch = int(flags[flags.index("--num-envs") + 1]) * job["rollout_length"]
    cwd = work / f"{impl}-s{seed}"  # CleanRL writes runs/<name>/ (TensorBoard) where it runs
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **THREADS_ENV, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    started = time.time()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    window: collections.deque[float] = collections.deque(maxlen=WINDOW)
    updates, clock, reached, last_step, printed_sps = 0, None, None, 0, None
    tail: collections.deque[str] = collections.deque(maxlen=30)
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.time()
        tail.append(line)
        if m := _EPISODE.search(line):
            last_step = int(m.group(1))
            window.append(float(m.group(2)))
            if len(window) == WINDOW and statistics.fmean(window) >= TARGET and not reached:
                reached = (now, last_step)
                proc.terminate()
        elif m := _SPS.match(line):
            updates += 1
            printed_sps = int(m.group(1))
            if clock is None and printed_sps > 0:
                clock = now - batch / printed_sps
    timer.cancel()
    proc.wait()
    if clock is None:  # no update finished: it failed, or the timeout was shorter than one
        raise RuntimeError(f"{impl} printed no SPS line (exit {proc.returncode}):\n{''.join(tail)}")
    end, steps = reached if reached else (now, max(last_step, updates * batch))
    return {
        "command": " ".join(cmd[1:]),
        "steps": steps,
        "sps": steps / max(end - clock, 1e-9),
        "sps_printed": printed_sps,  # its own last SPS line
        "reached_target_at_step": reached[1] if reached else None,
        "time_to_target_s": (reached[0] - clock) if reached else None,
        "time_to_target_from_launch_s": (reached[0] - started) if reached else None,
        "final_mean_return": statistics.fmean(window) if window else None,
        "timed_out": reached is None and time.time() - started >= timeout_s,
    }
