"""Exported language models, unquantized and quantized, as vLLM serves them.

For the unquantized export (fp) and each `rlfleet export --quantize` scheme (w8a8, w4a16,
w4a16-awq): size on disk (all files and the weights file), greedy agreement with fp (fraction
of held-out prompts whose greedy completion is token-for-token identical), log-prob drift (mean
|log p_scheme - log p_fp| over fp's greedy completion tokens, each scored by vLLM after the same
prefix), generated tokens/s in vLLM (greedy, ignore_eos, one batch; noisy on shared cores) and
accuracy on the held-out arithmetic set (the last <answer>N</answer> equals the reference).

The model: the newest finished LM run under runs/ (final/ with rlfleet_run.json) when there is
one, else a warm-started one made here with the learner's own pieces (tiny model, SFT on the
arith solutions, saved as a DeepSpeed checkpoint in runs/bench/export-run, i.e. version 0 of a
GRPO run). Every model runs in its own vLLM subprocess (learner.export.vllm_probe).

    python -m bench.serving.export             # every scheme; --schemes w8a8,w4a16
    python -m bench.serving.export --run runs/grpo-arith

Prints a table and writes bench/results/export.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._shared.lm import model_dir, vllm_environment
from bench._shared.results import RESULTS_DIR, WORK_DIR, machine, write_results

RESULTS = RESULTS_DIR / "export.json"
DATASET = {"generator": "arith", "digits": 1}
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def find_trained_run() -> Path | None:
    runs = Path("runs")
    candidates = [
        p.parent.parent
        for p in runs.glob("*/final/rlfleet_run.json")
        if (p.parent / "config.json").is_file() and (p.parent.parent / "config.yaml").is_file()
    ]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def warm_started_run(sft_steps: int) -> Path:
    """runs/bench/export-run: config.yaml + a checkpoint of the tiny model after SFT (what a
    GRPO run publishes as version 0), made once."""
    import torch
    import yaml

    from common.datasets import iter_tasks
    from learner.engine import build_engine
    from learner.lm.model import load_causal_lm, load_tokenizer
    from learner.lm.sft import expert_samples, sft_phase
    from learner.settings import DeepSpeedSettings, OptimizerSettings

    run = WORK_DIR / "export-run"
    if (run / "checkpoints" / "latest").is_file():
        return run
    base = model_dir("tiny")
    run.mkdir(parents=True, exist_ok=True)
    print(f"warm-starting {base} with {sft_steps} SFT steps into {run} ...", flush=True)
    torch.manual_seed(0)
    engine = build_engine(
        load_causal_lm(base),
        OptimizerSettings(lr=1e-3, eps=1e-8),
        DeepSpeedSettings(zero_stage=0, device="cpu"),
    )
    try:
        tokenizer = load_tokenizer(base)
        sft_phase(engine, tokenizer, expert_samples(iter_tasks(DATASET, split="train"), tokenizer),
                  steps=sft_steps, batch_size=32, learning_rate=1e-3)  # fmt: skip
        engine.save(run / "checkpoints", "update-00000000", {"updates": 0, "version": 0})
    finally:
        engine.close()
    job = {"kind": "grpo", "model_path": str(base), "dataset": DATASET, "device": "cpu",
           "sft_steps": sft_steps}  # fmt: skip
    (run / "config.yaml").write_text(
        yaml.safe_dump({"run": {"name": "bench-export", "dir": str(run)}, "job": job})
    )
    return run


def probe(folder: Path, request: dict[str, Any], work: Path) -> dict[str, Any]:
    req, res = work / f"{folder.name}-request.json", work / f"{folder.name}-result.json"
    req.write_text(json.dumps({"model": str(folder), **request}))
    env = {
        **os.environ,
        **vllm_environment(work),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "learner.export.vllm_probe", str(req), str(res)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM probe of {folder} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(res.read_text())
    out["probe_s"] = time.perf_counter() - started
    return out


def accuracy(texts: list[str], tasks: list[Any]) -> float:
    right = 0
    for text, task in zip(texts, tasks, strict=True):
        found = ANSWER.findall(text)
        right += bool(found) and found[-1].strip() == str(task.extra["answer"])
    return right / len(tasks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="an LM run (default: newest finished one under runs/)")
    parser.add_argument("--schemes", default="w8a8,w4a16,w4a16-awq")
    parser.add_argument("--eval-count", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--throughput-prompts", type=int, default=256)
    parser.add_argument("--sft-steps", type=int, default=150)
    args = parser.parse_args()

    from common.datasets import iter_tasks, take
    from learner.export import export

    started = machine()
    run = Path(args.run) if args.run else find_trained_run()
    model_note = "trained run"
    if run is None:
        model_note = (
            "no finished SFT/GRPO run under runs/: the warm-started model (tiny, "
            f"{args.sft_steps} SFT steps), as a GRPO run's version 0"
        )
        print(model_note)
        run = warm_started_run(args.sft_steps)
    work = WORK_DIR / f"export-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    tasks = take(iter_tasks(DATASET, split="eval"), args.eval_count)
    prompts = [t.prompt for t in tasks]
    schemes = ["fp", *[s for s in args.schemes.split(",") if s]]
    rows: dict[str, dict[str, Any]] = {}
    fp_greedy: list[list[int]] = []
    fp_seqs: list[list[int]] = []
    fp_from: list[int] = []
    fp_lp: list[list[float]] = []

    for scheme in schemes:
        out = work / scheme
        started = time.perf_counter()
        try:
            manifest = export(run, out, quantize=None if scheme == "fp" else scheme, force=True)
        except Exception as exc:  # a scheme that fails is reported, not fatal
            rows[scheme] = {"error": f"{type(exc).__name__}: {str(exc)[-500:]}"}
            print(f"{scheme}: export failed: {exc}")
            continue
        export_s = time.perf_counter() - started
        request: dict[str, Any] = {
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "throughput_prompts": args.throughput_prompts,
        }
        if scheme == "fp":
            request["score_self"] = True
        else:
            request |= {"score": fp_seqs, "score_from": fp_from}
        result = probe(out, request, work)
        greedy = [g["token_ids"] for g in result["greedy"]]
        if scheme == "fp":
            fp_greedy, fp_seqs, fp_from = greedy, result["score"], result["score_from"]
            fp_lp = result["score_logprobs"]
            drift = 0.0
        else:
            diffs = [abs(a - b) for q, f in zip(result["score_logprobs"], fp_lp, strict=True)
                     for a, b in zip(q, f, strict=True)]  # fmt: skip
            drift = sum(diffs) / max(1, len(diffs))
        files = manifest["files"]
        rows[scheme] = {
            "size_bytes": sum(e["bytes"] for e in files.values()),
            "weights_bytes": files["model.safetensors"]["bytes"],
            "greedy_agreement": sum(g == f for g, f in zip(greedy, fp_greedy, strict=True))
            / len(prompts),
            "logprob_drift": drift,
            "tokens_per_s": result.get("tokens_per_s"),
            "accuracy": accuracy([g["text"] for g in result["greedy"]], tasks),
            "export_s": export_s,
            "vllm_load_s": result["load_s"],
            "vllm_quantization": result["quantization"],
            "quantization": manifest["quantization"],
        }
    shutil.rmtree(work, ignore_errors=True)

    print()
    header = f"{'scheme':<10} {'size MB':>8} {'weights MB':>10} {'greedy=':>8} {'|dlogp|':>8} "
    header += f"{'tok/s':>8} {'accuracy':>8}"
    print(header)
    for scheme, row in rows.items():
        if "error" in row:
            print(f"{scheme:<10} failed: {row['error'][:80]}")
            continue
        print(
            f"{scheme:<10} {row['size_bytes'] / 1e6:8.2f} {row['weights_bytes'] / 1e6:10.2f} "
            f"{row['greedy_agreement']:8.3f} {row['logprob_drift']:8.4f} "
            f"{row['tokens_per_s'] or 0:8.0f} {row['accuracy']:8.3f}"
        )
    write_results(
        RESULTS,
        {
            "machine": {**started, "run": str(run), "model": model_note},
            "eval_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "throughput_prompts": args.throughput_prompts,
            "results": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
