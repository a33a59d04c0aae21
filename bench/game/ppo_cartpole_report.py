"""Ratios, targets and printed tables of ``bench/game/ppo_cartpole.py``'s results.

Ratios are always ``x / baseline`` (or ``system / x``): SPS ratios > 1 and time ratios < 1 are
the system (or x) ahead. A time ratio is None unless both sides reached 475.
"""

from __future__ import annotations

import statistics
from typing import Any

SPS_TARGET = 1.0  # system SPS >= 1.0x the baseline's
TIME_TARGET = 1.0  # system time to 475 <= the baseline's


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and "error" not in r


def _reached(r: dict[str, Any] | None) -> bool:
    return _ok(r) and r["reached_target_at_step"] is not None


def sps_ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return a["sps"] / b["sps"] if _ok(a) and _ok(b) and b["sps"] else None


def time_ratio(a, b, key: str = "time_to_target_s") -> float | None:
    if not (_ok(a) and _ok(b)) or a.get(key) is None or b.get("time_to_target_s") is None:
        return None
    return a[key] / b["time_to_target_s"]


def _time_met(system, base, key: str) -> bool:
    """Reached 475, no later than the baseline (or the baseline did not reach it at all)."""
    if not _ok(system) or system.get(key) is None:
        return False
    return (
        not _ok(base)
        or base.get("time_to_target_s") is None
        or (system[key] <= TIME_TARGET * base["time_to_target_s"])
    )


def _median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


def _target(name: str, flags: list[bool]) -> dict[str, Any]:
    return {"target": name, "per_seed": flags, "count": f"{sum(flags)}/{len(flags)}",
            "met": bool(flags) and all(flags)}  # fmt: skip


def annotate(result: dict[str, Any]) -> None:
    """Put each row's ratios (and the seeds' target flags) into the row itself."""
    for r in result.get("rows") or []:
        x, b = r["system"], r["baseline"]
        r["sps_ratio"], r["time_to_target_ratio"] = sps_ratio(x, b), time_ratio(x, b)
        r["targets"] = {
            "sps": (r["sps_ratio"] or 0) >= SPS_TARGET,
            "time_to_target": _time_met(x, b, "time_to_target_s"),
            "time_to_target_from_launch": _time_met(x, b, "time_to_target_from_launch_s"),
        }
    for c in (result.get("scaling") or {}).get("cells") or []:
        c["sps_ratio"] = sps_ratio(c["system"], c["baseline"])
        c["time_to_target_ratio"] = time_ratio(c["system"], c["baseline"])
    for p in result.get("colocated_vs_grpc") or []:
        p["shm_over_grpc_sps"] = sps_ratio(p["shm"], p["grpc"])
        p["shm_over_baseline_sps"] = sps_ratio(p["shm"], p["baseline"])
        p["grpc_over_baseline_sps"] = sps_ratio(p["grpc"], p["baseline"])
    for r in (result.get("compare") or {}).get("rows") or []:
        r["ratios"] = {
            impl: {"sps_over_baseline": sps_ratio(r[impl], r["baseline"]),
                   "time_to_target_over_baseline": time_ratio(r[impl], r["baseline"]),
                   "system_sps_over_it": sps_ratio(r.get("system"), r[impl]),
                   "system_time_to_target_over_it": time_ratio(r.get("system"), r[impl])}
            for impl in ("cleanrl", "envpool") if impl in r
        }  # fmt: skip


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    annotate(result)
    out: dict[str, Any] = {}
    rows = result.get("rows") or []
    if rows:
        pairs = [(r["system"], r["baseline"]) for r in rows]
        sps = [sps_ratio(s, b) for s, b in pairs]
        out.update(
            seeds=[r["seed"] for r in rows],
            sps_ratios=sps,
            sps_ratio_median=_median(sps),
            time_to_target_ratios=[time_ratio(s, b) for s, b in pairs],
            time_to_target_ratio_median=_median([time_ratio(s, b) for s, b in pairs]),
            time_to_target_from_launch_ratio_median=_median(
                [time_ratio(s, b, "time_to_target_from_launch_s") for s, b in pairs]
            ),
            system_time_to_target_s_median=_median(
                [s.get("time_to_target_s") for s, _ in pairs if _ok(s)]
            ),
            system_startup_s_median=_median([s.get("startup_s") for s, _ in pairs if _ok(s)]),
            baseline_time_to_target_s_median=_median(
                [b.get("time_to_target_s") for _, b in pairs if _ok(b)]
            ),
            system_reached=sum(_reached(x) for x, _ in pairs),
            baseline_reached=sum(_reached(b) for _, b in pairs),
        )
        targets = {
            "sps": _target(f"system SPS >= {SPS_TARGET}x baseline, every seed",
                           [(v or 0) >= SPS_TARGET for v in sps]),
            "time_to_target": _target(
                "system time to 475 (from the first env step) <= baseline's, every seed",
                [_time_met(s, b, "time_to_target_s") for s, b in pairs]),
            "time_to_target_from_launch": _target(
                "system time to 475 from launch (start-up included) <= baseline's, every seed",
                [_time_met(s, b, "time_to_target_from_launch_s") for s, b in pairs]),
        }  # fmt: skip
        out["targets"] = targets
        appo = [(r["appo"], r["baseline"]) for r in rows if "appo" in r]
        if appo:
            out["appo_sps_ratios"] = [sps_ratio(a, b) for a, b in appo]
            out["appo_sps_ratio_median"] = _median(out["appo_sps_ratios"])
            out["appo_time_to_target_ratio_median"] = _median([time_ratio(a, b) for a, b in appo])
    cells = (result.get("scaling") or {}).get("cells") or []
    if cells:
        out["scaling_sps_ratios"] = {
            f"{c['actors']}a x {c['envs']}e": sps_ratio(c["system"], c["baseline"]) for c in cells
        }
    pairs = result.get("colocated_vs_grpc") or []
    if pairs:
        out["shm_over_grpc_sps"] = {
            f"{p['actors']}a x {p['envs']}e": sps_ratio(p["shm"], p["grpc"]) for p in pairs
        }
    compare = result.get("compare") or {}
    if compare.get("rows"):
        for impl in ("cleanrl", "envpool"):
            got = [r for r in compare["rows"] if _ok(r.get(impl))]
            out[f"{impl}_over_baseline_sps_median"] = _median(
                [sps_ratio(r[impl], r["baseline"]) for r in got]
            )
            out[f"system_over_{impl}_sps_median"] = _median(
                [sps_ratio(r.get("system"), r[impl]) for r in got]
            )
            out[f"system_over_{impl}_time_to_target_median"] = _median(
                [time_ratio(r.get("system"), r[impl]) for r in got]
            )
    elif compare.get("error"):
        out["compare_error"] = compare["error"]
    return out


# --- printing ---------------------------------------------------------------------------------


def _f(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "met" if value else "NOT met"
    return format(value, spec) if isinstance(value, int | float) else str(value)


def _table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def _side(r: dict[str, Any] | None) -> list[str]:
    """steps to 475, s to 475, SPS (or the error)."""
    if not _ok(r):
        return ["ERROR" if r else "-", "-", "-"]
    return [_f(r["reached_target_at_step"], "d"), _f(r["time_to_target_s"]), _f(r["sps"], ".0f")]


def print_report(result: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    rows = result.get("rows") or []
    if rows:
        body = []
        for r in rows:
            for kind in ("system", "appo"):
                if kind not in r:
                    continue
                x, b = r[kind], r["baseline"]
                launch = x.get("time_to_target_from_launch_s") if _ok(x) else None
                body.append([str(r["seed"]), kind, *_side(b), *_side(x), _f(launch),
                             _f(x.get("startup_s") if _ok(x) else None),
                             _f(sps_ratio(x, b), ".2f"), _f(time_ratio(x, b), ".2f"),
                             _f((sps_ratio(x, b) or 0) >= SPS_TARGET),
                             _f(_time_met(x, b, "time_to_target_s")),
                             _f(_time_met(x, b, "time_to_target_from_launch_s"))])  # fmt: skip
        _table("seeds: system vs single-process baseline (same hyperparameters; s from the first "
               "env step)", ["seed", "side", "base steps", "base s", "base SPS", "steps", "s",
               "SPS", "s launch", "start-up", "SPS x", "time x", "SPS>=1x", "time<=1x",
               "launch<=1x"], body)  # fmt: skip
        for t in (s.get("targets") or {}).values():
            print(f"  target: {t['target']}: {t['count']} -> {_f(t['met'])}")
        print(f"  median SPS ratio {_f(s.get('sps_ratio_median'), '.2f')}, median time ratio "
              f"{_f(s.get('time_to_target_ratio_median'), '.2f')} (from launch "
              f"{_f(s.get('time_to_target_from_launch_ratio_median'), '.2f')})")  # fmt: skip
    cells = (result.get("scaling") or {}).get("cells") or []
    if cells:
        body = [[str(c["actors"]), str(c["envs"]), str(c["envs_per_actor"]),
                 c["system"].get("transport", "-") if _ok(c["system"]) else "-",
                 *_side(c["baseline"]), *_side(c["system"]),
                 _f(c["system"].get("final_mean_return") if _ok(c["system"]) else None),
                 _f(sps_ratio(c["system"], c["baseline"]), ".2f"),
                 _f(time_ratio(c["system"], c["baseline"]), ".2f")] for c in cells]  # fmt: skip
        sc = result["scaling"]
        _table(f"scaling: system vs baseline with the same envs (seed {sc['seed']}, budget "
               f"{sc['total_timesteps']} steps or {sc['timeout_s']:.0f}s)",
               ["actors", "envs", "per actor", "path", "base steps", "base s", "base SPS",
                "steps", "s", "SPS", "final", "SPS x", "time x"], body)  # fmt: skip
    pairs = result.get("colocated_vs_grpc") or []
    if pairs:
        body = [[str(p["actors"]), str(p["envs"]), _side(p["shm"])[2], _side(p["grpc"])[2],
                 _f(sps_ratio(p["shm"], p["grpc"]), ".2f"),
                 _f(sps_ratio(p["shm"], p["baseline"]), ".2f"),
                 _f(sps_ratio(p["grpc"], p["baseline"]), ".2f"), _side(p["shm"])[1],
                 _side(p["grpc"])[1]] for p in pairs]  # fmt: skip
        _table("co-located (shm) vs gRPC env path", ["actors", "envs", "shm SPS", "grpc SPS",
               "shm/grpc", "shm x base", "grpc x base", "shm s", "grpc s"], body)  # fmt: skip
    compare = result.get("compare") or {}
    if compare.get("error"):
        print(f"\ncompare: {compare['error']}")
    elif compare.get("rows"):
        body = []
        for r in compare["rows"]:
            for impl in ("baseline", "system", "cleanrl", "envpool"):
                x = r.get(impl)
                if x is None:
                    continue
                body.append([str(r["seed"]), impl, *_side(x),
                             _f(sps_ratio(x, r["baseline"]), ".2f"),
                             _f(time_ratio(x, r["baseline"]), ".2f"),
                             _f(sps_ratio(r.get("system"), x), ".2f"),
                             _f(time_ratio(r.get("system"), x), ".2f")])  # fmt: skip
        v = compare.get("versions") or {}
        _table(f"compare (budget {compare.get('total_timesteps')} steps; cleanrl "
               f"{v.get('cleanrl')}, envpool {v.get('envpool')})", ["seed", "impl", "steps",
               "s", "SPS", "SPS x base", "time x base", "system/x SPS", "system/x time"],
               body)  # fmt: skip
    errors = sorted(set(_errors(result)))
    if errors:
        print("\nerrors (ERROR in the tables):")
        for e in errors:
            print(f"  {e}")


def _errors(node: Any, path: str = "") -> list[str]:
    """Every run's error, with where it is in the result."""
    if isinstance(node, dict):
        if isinstance(node.get("error"), str):
            return [f"{path or 'result'}: {node['error'].splitlines()[0][:300]}"]
        return [e for k, v in node.items() if k != "summary" for e in _errors(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [e for i, v in enumerate(node) for e in _errors(v, f"{path}[{i}]")]
    return []
