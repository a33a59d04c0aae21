"""Sampler throughput: generated tokens/s of one workload through the SamplerService over gRPC,
through the raw vLLM engine in this process, and through transformers ``generate``.

Workload (default): 32 arith prompts x n=8 x 32 tokens, temperature 1, ignore_eos (every
completion has exactly 32 tokens), per-token logprobs on (what RL asks for), tiny model.

- service: ``python -m launch.cli serve sampler`` in its own process (as deployed), called
  with sampler/client.SamplerClient on loopback; token-id prompts, one Generate call.
- raw vLLM: a ``vllm.v1`` AsyncLLM in this process, built with the arguments
  sampler/engines/vllm_engine.py uses (same KV cache, max_num_seqs, logprobs mode), one request
  per prompt with the same SamplingParams, gathered; nothing done with the outputs.
- transformers: ``model.generate`` on the 32 left-padded prompts, do_sample, top_k off,
  num_return_sequences=8, 32 new tokens, output_scores + compute_transition_scores for the
  logprobs; one torch thread, as vLLM's CPU worker (VLLM_CPU_OMP_THREADS_BIND=auto binds its
  one OMP thread to core 0 and reserves the other core of this 2-core machine).

The three alternate (service, raw, transformers, service, ...) after one warm-up call each;
the table shows medians over ``--repeats`` rounds. Engine start-up is reported separately, and so
is the first (warm-up) call: vLLM's first batch after start takes far longer than later ones.

    python -m bench.lm.sampler_throughput      # tiny model, 5 rounds
    python -m bench.lm.sampler_throughput --model-size small --repeats 3

Target: service >= 0.9x raw vLLM. Prints a table and writes bench/results/sampler_throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

from bench._shared.lm import (
    SamplerProcess,
    arith_tasks,
    model_dir,
    model_parameters,
    vllm_environment,
)
from bench._shared.results import RESULTS_DIR, WORK_DIR, machine, median, write_results

RESULTS = RESULTS_DIR / "sampler_throughput.json"
TARGET = 0.9
KV_CACHE_GIB = 1
MAX_NUM_SEQS = 256


# --------------------------------------------------------------------------- the three sides


class Service:
    name = "service"

    def __init__(self, proc: SamplerProcess) -> None:
        from clients.sampler import SamplerClient

        self.client = SamplerClient(proc.address)

    async def run(self, prompts: list[list[int]], a: argparse.Namespace) -> int:
        from common import tensor

        reply = await self.client.generate(
            prompts,
            n=a.n,
            max_tokens=a.max_tokens,
            temperature=1.0,
            ignore_eos=True,
            logprobs=a.logprobs,
        )
        return sum(len(tensor.decode(c.token_ids)) for r in reply.results for c in r.completions)

    async def close(self) -> None:
        await self.client.close()


class RawVllm:
    name = "raw vLLM"

    def __init__(self, model: Path) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # The arguments of sampler/engines/vllm_engine.VllmEngine, minus its worker extension.
        args = AsyncEngineArgs(
            model=str(model),
            tokenizer=str(model),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            max_logprobs=20,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=KV_CACHE_GIB << 30,
            max_num_seqs=MAX_NUM_SEQS,
            disable_log_stats=True,
        )
        started = time.perf_counter()
        self.llm = AsyncLLM.from_engine_args(args)
        self.start_s = time.perf_counter() - started

    async def run(self, prompts: list[list[int]], a: argparse.Namespace) -> int:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=a.n,
            temperature=1.0,
            max_tokens=a.max_tokens,
            ignore_eos=True,
            logprobs=0 if a.logprobs else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

        async def one(prompt: list[int]) -> int:
            final = None
            request = {"prompt_token_ids": prompt}
            async for out in self.llm.generate(request, params, uuid.uuid4().hex):
                final = out
            assert final is not None
            return sum(len(o.token_ids) for o in final.outputs)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))

    async def close(self) -> None:
        self.llm.shutdown()
        del self.llm  # now, not in __del__ at interpreter exit (vLLM raises a TypeError there)


class Transformers:
    name = "transformers"

    def __init__(self, model: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        started = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.start_s = time.perf_counter() - started
        self.pad = self.tokenizer.pad_token_id

    async def run(self, prompts: list[list[int]], a: argparse.Namespace) -> int:
        import torch

        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=a.max_tokens,
                min_new_tokens=a.max_tokens,  # ignore_eos
                num_return_sequences=a.n,
                pad_token_id=self.pad,
                output_scores=a.logprobs,
                return_dict_in_generate=True,
            )
            new = out.sequences[:, width:]
            if a.logprobs:
                logp = self.model.compute_transition_scores(
                    out.sequences, out.scores, normalize_logits=True
                )
                assert logp.shape == new.shape
        return int(new.numel())

    async def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the run


async def measure(sides: list[Any], prompts: list[list[int]], a: argparse.Namespace) -> dict:
    expected = len(prompts) * a.n * a.max_tokens
    first_call_s = {}
    for side in sides:  # warm-up
        started = time.perf_counter()
        await side.run(prompts, a)
        first_call_s[side.name] = time.perf_counter() - started
    samples: dict[str, Any] = {s.name: [] for s in sides}
    samples["first_call_s"] = first_call_s
    for round_ in range(a.repeats):
        order = sides[round_ % len(sides) :] + sides[: round_ % len(sides)]  # rotate the lead
        for side in order:
            started = time.perf_counter()
            tokens = await side.run(prompts, a)
            seconds = time.perf_counter() - started
            if tokens != expected:
                raise SystemExit(f"{side.name}: {tokens} tokens, expected {expected}")
            samples[side.name].append(
                {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
            )
        print(
            f"round {round_ + 1}/{a.repeats}: "
            + ", ".join(f"{s.name} {samples[s.name][-1]['tokens_per_s']:.0f} tok/s" for s in sides),
            flush=True,
        )
    return samples


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    model = model_dir(a.model_size)
    run_dir = WORK_DIR / f"sampler_throughput-{os.getpid()}"
    env = vllm_environment(run_dir, KV_CACHE_GIB)  # before vLLM is imported here
    tasks = arith_tasks(a.prompts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    # As the service renders text prompts (add_special_tokens=True); sent as ids to all three.
    prompts = [list(tokenizer(t.prompt, add_special_tokens=True)["input_ids"]) for t in tasks]

    settings = {
        "max_n": max(16, a.n),
        "max_prompts_per_request": max(256, a.prompts),
        "kv_cache_gib": KV_CACHE_GIB,
        "max_num_seqs": MAX_NUM_SEQS,
    }
    proc = SamplerProcess(model, run_dir, settings=settings)
    startup: dict[str, float | None] = {}
    sides: list[Any] = []
    try:
        startup["service_process_to_serving_s"] = proc.wait_ready()
        startup["service_engine_s"] = proc.engine_start_s()
        sides.append(Service(proc))
        raw = RawVllm(model)
        startup["raw_vllm_engine_s"] = raw.start_s
        sides.append(raw)
        hf = Transformers(model, a.hf_threads)
        startup["transformers_load_s"] = hf.start_s
        sides.append(hf)
        samples = await measure(sides, prompts, a)
        startup["first_call_s"] = samples.pop("first_call_s")
    finally:
        for side in sides:
            await side.close()
        proc.stop()

    med = {name: median(s["tokens_per_s"] for s in runs) for name, runs in samples.items()}
    return {
        "workload": {
            "model_size": a.model_size,
            "parameters": model_parameters(model),
            "prompts": a.prompts,
            "n": a.n,
            "max_tokens": a.max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "logprobs": a.logprobs,
            "tokens_per_call": a.prompts * a.n * a.max_tokens,
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "repeats": a.repeats,
            "hf_threads": a.hf_threads,
            "vllm_env": env,
        },
        "startup_s": startup,
        "median_tokens_per_s": med,
        "ratios": {
            "service_vs_raw_vllm": med["service"] / med["raw vLLM"],
            "raw_vllm_vs_transformers": med["raw vLLM"] / med["transformers"],
            "service_vs_transformers": med["service"] / med["transformers"],
        },
        "target_service_vs_raw": TARGET,
        "samples": samples,
    }


def print_table(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"\n{w['model_size']} model ({w['parameters'] / 1e6:.1f}M params): {w['prompts']} prompts"
        f" x n={w['n']} x {w['max_tokens']} tokens, logprobs={w['logprobs']}, "
        f"medians of {w['repeats']}"
    )
    header = f"{'path':14} {'tokens/s':>10} {'s/call':>8} {'vs raw vLLM':>12}"
    print(header)
    print("-" * len(header))
    raw = r["median_tokens_per_s"]["raw vLLM"]
    for name, tps in r["median_tokens_per_s"].items():
        secs = median(s["seconds"] for s in r["samples"][name])
        print(f"{name:14} {tps:10.0f} {secs:8.3f} {tps / raw:11.2f}x")
    ratios = r["ratios"]
    verdict = "meets" if ratios["service_vs_raw_vllm"] >= TARGET else "BELOW"
    print(
        f"service / raw vLLM = {ratios['service_vs_raw_vllm']:.2f}x ({verdict} the {TARGET}x "
        f"target); raw vLLM / transformers = {ratios['raw_vllm_vs_transformers']:.2f}x"
    )
    s = r["startup_s"]
    print(
        f"start-up: service process to SERVING {s['service_process_to_serving_s']:.1f} s "
        f"(engine {s['service_engine_s'] or float('nan'):.1f} s), raw vLLM engine "
        f"{s['raw_vllm_engine_s']:.1f} s, transformers load {s['transformers_load_s']:.1f} s"
    )
    print(
        "first (warm-up) call, not in the table: "
        + ", ".join(f"{name} {secs:.1f} s" for name, secs in s["first_call_s"].items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "small", "base100m"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-logprobs", dest="logprobs", action="store_false")
    parser.add_argument("--hf-threads", type=int, default=1, help="torch threads (transformers)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    info = machine()
    result = asyncio.run(amain(a))
    print_table(result)
    write_results(a.out, {"machine": info, **result})


if __name__ == "__main__":
    main()
