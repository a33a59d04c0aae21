"""The full system versus single-process PPO on CartPole-v1, side by side in one run.

Sections (``--only`` picks some; the others are kept from the JSON already at ``--out``):

- ``seeds``: per seed, in alternation (so background load hits every side alike), the baseline
  (``bench/game/ppo_baseline.py``: one process, one ``SyncVectorEnv``) and the system
  (``rlfleet up`` on ``examples/cartpole_ppo.yaml``: embedded NATS, an env server, an actor and
  the DeepSpeed learner as processes) at the same hyperparameters; with ``--appo`` also the fleet on
  ``examples/cartpole_appo.yaml``. Targets, each in every seed: system SPS >= 1.0x the
  baseline's, time to a mean return of 475 <= the baseline's.
- ``compare``: CleanRL 1.2.0's own ``ppo.py`` and the same loop over EnvPool's CartPole
  (``bench/game/ppo_envpool.py``) at the same hyperparameters, budget and seeds, in their own venv
  (``bench/.venv-compare`` from ``bench/game/requirements-compare.txt``, made on first use); run in
  the same per-seed alternation as ``seeds``.
- ``scaling``: the system with 1, 2, 4 actors and 8, 64, 256 envs in all (``Plan.grid``: actors
  at 64 envs, envs at 2 actors; one fragment per actor per update, so the batch is 32 x envs, as
  the baseline's with that many envs), each against the baseline with the same envs; and the
  co-located (shared-memory) env path against gRPC only (``colocated: off`` on the env server).

Every run stops at a mean return of 475 over the last 20 episodes, its step budget or its
timeout. Times run from the first env step (the baseline's clock; the system's start-up, launch
to the first env step, is reported beside it); SPS is env steps over that time.

    python -m bench.game.ppo_cartpole             # every section
    python -m bench.game.ppo_cartpole --quick     # smoke check: tiny budgets, one seed
    python -m bench.game.ppo_cartpole --only seeds --seeds 1 2 3 [--appo] [--profile-updates 40]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from bench._shared.job_overrides import apply_overrides, parse_overrides
from bench._shared.results import RESULTS_DIR, ROOT, results_json
from bench.game import ppo_cartpole_runs as runs
from bench.game.ppo_cartpole_report import print_report, summarize

EXAMPLE = ROOT / "examples" / "cartpole_ppo.yaml"
APPO_EXAMPLE = ROOT / "examples" / "cartpole_appo.yaml"
SECTIONS = ("seeds", "compare", "scaling")


@dataclass(frozen=True)
class Plan:
    """Budgets. ``None`` keeps the run file's total_timesteps (the lr anneals over it)."""

    seed_budget: int | None = None
    seed_timeout_s: float = 180.0
    grid: tuple[tuple[int, int], ...] = ((1, 64), (2, 8), (2, 64), (4, 64), (2, 256), (4, 256))
    grpc: tuple[tuple[int, int], ...] = ((2, 8), (2, 64), (2, 256))  # also run over gRPC only
    cell_budget: int | None = None
    cell_timeout_s: float = 100.0  # from launch; the baseline gets as long from its first step
    compare_timeout_s: float = 75.0


FULL = Plan()
QUICK = Plan(
    seed_budget=3072,
    seed_timeout_s=120.0,
    grid=((1, 8), (2, 8)),
    grpc=((2, 8),),
    cell_budget=3072,
    cell_timeout_s=120.0,
    compare_timeout_s=60.0,
)


class Bench:
    """Runs each distinct (side, hyperparameters, seed) once per invocation and keeps it."""

    def __init__(self, work: Path, result: dict[str, Any], out: Path) -> None:
        self.work, self.result, self.out = work, result, out
        self.cache: dict[str, dict[str, Any]] = {}
        self.seeds = True  # the seeds section runs (else only the baselines compare needs)

    def once(self, key: Any, label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        k = json.dumps(key, sort_keys=True, default=str)
        if k not in self.cache:
            t0 = time.time()
            try:
                self.cache[k] = fn()
            except Exception as exc:  # one failed run is recorded, the others go on
                self.cache[k] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            self.cache[k]["run_s"] = round(time.time() - t0, 1)
            _print_run(label, self.cache[k])
        return self.cache[k]

    def baseline(self, job: dict[str, Any], seed: int, max_wall_s: float | None = None):
        key = ["baseline", runs.baseline_args(job, seed).__dict__]
        label = f"baseline {job['num_envs'] * job['fragments_per_update']} envs seed {seed}"
        return self.once(key, label, lambda: runs.baseline(job, seed, max_wall_s))

    def system(self, config: dict[str, Any], seed: int, label: str, timeout_s: float):
        return self.once(
            ["system", config, seed],
            f"{label} seed {seed}",
            lambda: runs.system(config, seed, self.work, label.replace(" ", "-"), timeout_s),
        )

    def save(self) -> None:
        self.result["summary"] = summarize(self.result)
        self.result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(results_json(self.result))


def _budget(config: dict[str, Any], steps: int | None) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    if steps is not None:
        config["job"]["total_timesteps"] = steps
    return config


def run_seeds(b: Bench, plan: Plan, config, appo, seeds: list[int], compare: Path | None):
    """The seeds section, and with a comparison venv path the compare section, seed by seed:
    baseline, system[, appo][, cleanrl, envpool] in turn, so load hits every side alike."""
    config = _budget(config, plan.seed_budget)
    python = _compare_section(b, config, compare) if compare is not None else None
    rows: list[dict[str, Any]] = []
    if b.seeds:
        b.result["rows"] = rows
    for seed in seeds:
        base = b.baseline(config["job"], seed)
        if b.seeds:
            row = {"seed": seed, "baseline": base,
                   "system": b.system(config, seed, "ppo", plan.seed_timeout_s)}  # fmt: skip
            if appo is not None:
                row["appo"] = b.system(_budget(appo, plan.seed_budget), seed, "appo",
                                       plan.seed_timeout_s)  # fmt: skip
            rows.append(row)
            b.save()
        if python is not None:
            crow: dict[str, Any] = {"seed": seed, "baseline": base}
            if b.seeds:
                crow["system"] = rows[-1]["system"]
            for impl in ("cleanrl", "envpool"):
                crow[impl] = b.once(
                    [impl, config["job"], seed],
                    f"{impl} seed {seed}",
                    _compare(impl, python, config["job"], seed, b.work, plan.compare_timeout_s),
                )
            b.result["compare"]["rows"].append(crow)
            b.save()


def _compare_section(b: Bench, config: dict[str, Any], venv: Path) -> Path | None:
    """The compare section's header; the comparison venv's python, or None (the reason kept)."""
    flags = " ".join(runs.cleanrl_flags(config["job"], 1))
    section: dict[str, Any] = {
        "venv": str(venv),
        "total_timesteps": config["job"]["total_timesteps"],
        "commands": {
            "cleanrl": f"python -m cleanrl.ppo {flags} --cuda False",
            "envpool": f"python bench/game/ppo_envpool.py {flags}",
        },
        "rows": [],
    }
    b.result["compare"] = section
    try:
        python = runs.ensure_compare_venv(venv)
        section["versions"] = runs.compare_versions(python)
        return python
    except Exception as exc:
        section["error"] = f"comparison venv unavailable: {exc}"[:2000]
        print(section["error"], flush=True)
        b.save()
        return None


def run_scaling(b: Bench, plan: Plan, config, seed: int) -> None:
    base = _budget(config, plan.cell_budget)
    grid: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    b.result["scaling"] = {
        "seed": seed,
        "grid": [list(c) for c in plan.grid],
        "total_timesteps": base["job"]["total_timesteps"],
        "timeout_s": plan.cell_timeout_s,
        "env_servers": base["job"].get("env_servers", 1),
        "cells": grid,
    }
    b.result["colocated_vs_grpc"] = pairs
    cells = [(a, e, "auto") for a, e in plan.grid] + [(a, e, "off") for a, e in plan.grpc]
    cells.sort(key=lambda c: (c[1], c[0], c[2]))  # one env count at a time: its baseline first
    for actors, envs, colocated in cells:
        cfg = runs.variant(base, actors, envs, colocated=colocated)
        bl = b.baseline(cfg["job"], seed, plan.cell_timeout_s)
        path = "shm" if colocated == "auto" else "grpc"
        sysrun = b.system(cfg, seed, f"{actors}a-{envs}e-{path}", plan.cell_timeout_s)
        cell = {"actors": actors, "envs": envs, "envs_per_actor": envs // actors,
                "colocated": colocated, "system": sysrun, "baseline": bl}  # fmt: skip
        if colocated == "auto":
            grid.append(cell)
        else:
            shm = next((c for c in grid if (c["actors"], c["envs"]) == (actors, envs)), None)
            pairs.append({"actors": actors, "envs": envs, "baseline": bl, "grpc": sysrun,
                          "shm": shm["system"] if shm else None})  # fmt: skip
        b.save()


def _compare(impl: str, python: Path, job, seed: int, work: Path, timeout_s: float):
    return lambda: runs.compare_run(impl, python, job, seed, work, timeout_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke check: tiny budgets, 1 seed")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default 1 2 3; quick: 1)")
    parser.add_argument("--out", type=Path, help="JSON (default bench/results/ppo_cartpole.json; "
                        "quick: ppo_cartpole_quick.json in the temp dir)")  # fmt: skip
    parser.add_argument("--config", type=Path, default=EXAMPLE, help="a ppo job run file")
    parser.add_argument("--appo", action="store_true", help="also the appo job in `seeds`")
    parser.add_argument("--appo-config", type=Path, default=APPO_EXAMPLE)
    parser.add_argument("--compare-venv", type=Path, default=ROOT / "bench" / ".venv-compare")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override job keys of every run (YAML values), e.g. "
                        "double_buffer=on")  # fmt: skip
    parser.add_argument("--profile-updates", type=int, default=0,
                        help="profile N updates of each job's learner first (0: none)")  # fmt: skip
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    seeds = args.seeds or ([1] if args.quick else [1, 2, 3])
    sections = args.only or list(SECTIONS)
    out = args.out or (
        Path(tempfile.gettempdir()) / "ppo_cartpole_quick.json"
        if args.quick
        else RESULTS_DIR / "ppo_cartpole.json"
    )
    overrides = parse_overrides(args.set)
    config = yaml.safe_load(args.config.read_text())
    apply_overrides(config["job"], overrides)
    appo = yaml.safe_load(args.appo_config.read_text()) if args.appo else None
    if appo is not None:
        apply_overrides(appo["job"], overrides)

    result: dict[str, Any] = {}
    if args.only and out.exists():  # keep the sections not run now
        result = json.loads(out.read_text())
    result.update(
        benchmark="ppo_cartpole",
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine={
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg(),
        },
        config=str(args.config),
        git=_git(),
        hyperparameters=config["job"],
        target_return=runs.TARGET,
        return_window=runs.WINDOW,
        plan={**asdict(plan), "quick": args.quick, "sections": sections, "seeds": seeds},
    )
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        b = Bench(Path(tmp), result, out)
        if args.profile_updates:
            from bench.game.ppo_update_profile import print_profile, profile

            result["update_profile"] = {}
            for kind, path in (("ppo", args.config), ("appo", args.appo_config)):
                prof = profile(path, args.profile_updates, Path(tmp) / f"prof-{kind}")
                result["update_profile"][kind] = prof
                print_profile(prof)
        b.seeds = "seeds" in sections
        if b.seeds or "compare" in sections:
            venv = args.compare_venv if "compare" in sections else None
            run_seeds(b, plan, config, appo, seeds, venv)
        if "scaling" in sections:
            run_scaling(b, plan, config, seeds[0])
        b.save()
    print_report(result)
    print(f"wrote {out}")
    return 0


def _git() -> dict[str, Any]:
    """The commit and the files changed in the working tree (the code the system ran)."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout

    return {"commit": git("rev-parse", "HEAD").strip(),
            "changed": git("status", "--porcelain").splitlines()}  # fmt: skip


def _print_run(label: str, r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"  {label}: ERROR {r['error'].splitlines()[0]}", flush=True)
        return
    t = r.get("time_to_target_s")
    print(
        f"  {label}: {r['steps']} steps, {r['sps']:.0f} SPS, "
        + (f"475 at {r['reached_target_at_step']} steps in {t:.1f}s" if t else "475 not reached")
        + (f" (start-up {r['startup_s']:.1f}s, via {r['transport']})" if "startup_s" in r else "")
        + f" [{r['run_s']:.0f}s]",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
