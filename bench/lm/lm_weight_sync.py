"""LM weight sync: from the learner's announcement of version k to the first sample with k.

The learner side runs in this process: a real WeightStore and WeightService on a GrpcServer,
announcements (learner.weights.announce) on a real NATS (services.bus.EmbeddedNats). The sampler
is ``python -m launch.cli serve sampler`` in its own process, following the run
(weights_from = this learner). For each version: perturb the weights, ``store.publish`` (not
in the latency: the learner publishes before it announces), announce, then call Generate
(1 prompt, 1 token) back to back until a completion carries policy_version k.

The latency is broken down from the sampler's log (same machine, same clock): notify + fetch
(announce -> "fetched weights vK"), gate wait (running generations finish), load ("serving
weights vK (loaded in X ms)", of which vLLM's reload_weights + prefix-cache reset is "vLLM:
weights vK loaded (N tensors) in X ms"), and first sample (served -> first reply with vK).

Floor, measured in the same run from a separate client process (the sampler's position):
bytes / the bandwidth of bench/transport/weight_sync.py's raw gRPC stream (same chunks, no
protobuf, no checksums), plus the vLLM reload time. "fetch alone" is
common.weights.fetch_weights of the same version from that client, with no engine to feed.

    python -m bench.lm.lm_weight_sync      # tiny and base100m (~100M), 5 versions
    python -m bench.lm.lm_weight_sync --sizes tiny --repeats 10

Prints a table and writes bench/results/lm_weight_sync.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench._shared.lm import (
    SamplerProcess,
    arith_tasks,
    first_sample_of,
    model_dir,
    model_parameters,
    start_weight_server,
    sync_breakdown,
    vllm_environment,
)
from bench._shared.results import RESULTS_DIR, ROOT, WORK_DIR, machine, median, write_results

RESULTS = RESULTS_DIR / "lm_weight_sync.json"
PARTS = ("fetch_s", "gate_wait_s", "load_s", "vllm_reload_s", "first_sample_s", "total_s")


# --------------------------------------------------------------------------- floor client


async def floor_client(address: str, version: int, repeats: int) -> dict[str, Any]:
    """Runs in a child process (the sampler's position): raw stream and fetch_weights times."""
    from bench.transport.weight_sync import raw_stream
    from clients.learner import fetch_weights
    from services.server import channel

    out: dict[str, Any] = {"raw_stream_s": [], "fetch_alone_s": []}
    async with channel(address) as chan:
        await fetch_weights(chan, version)  # warm: the server caches the chunk CRCs
        for _ in range(repeats):
            started = time.perf_counter()
            out["bytes"] = await raw_stream(chan, version)
            out["raw_stream_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await fetch_weights(chan, version)
            out["fetch_alone_s"].append(time.perf_counter() - started)
    return out


def measure_floor(address: str, version: int, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", __spec__.name, "--floor-client", address]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*cmd, str(version), str(repeats)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"floor client failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- one model


def disk_weights(model: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model)
    return {k: v.detach().clone().contiguous() for k, v in loaded.state_dict().items()}


async def run_size(size: str, a: argparse.Namespace, nats_url: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from clients.sampler import SamplerClient
    from learner.weights import announce
    from services.bus import Bus

    model = model_dir(size)
    run = f"wsync-{size}-{uuid.uuid4().hex[:6]}"
    run_dir = WORK_DIR / f"lm_weight_sync-{os.getpid()}" / size
    vllm_environment(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = list(tokenizer(arith_tasks(1)[0].prompt)["input_ids"])
    state = await asyncio.to_thread(disk_weights, model)
    store, learner = await start_weight_server(run, keep=2, raw_stream=True)
    manifest = await asyncio.to_thread(store.publish, state)  # v0: what the sampler starts on
    bus = await Bus.connect(nats_url, name=f"bench-learner-{size}")
    sampler = SamplerProcess(
        model,
        run_dir,
        run=run,
        nats_url=nats_url,
        weights_from=learner.address,
        settings={"max_model_len": 256},
    )
    out: dict[str, Any] = {
        "parameters": model_parameters(model),
        "bytes": int(manifest.total_bytes),
        "tensors": len(manifest.tensors),
        "samples": [],
        "publish_s": [],
    }
    try:
        out["sampler_ready_s"] = await asyncio.to_thread(sampler.wait_ready)
        out["engine_start_s"] = sampler.engine_start_s()
        floor = await asyncio.to_thread(measure_floor, learner.address, 0, a.floor_repeats)
        out.update(raw_stream_s=floor["raw_stream_s"], fetch_alone_s=floor["fetch_alone_s"])
        async with SamplerClient(sampler.address) as client:
            await first_sample_of(client, prompt, 0)  # warm
            for k in range(1, a.repeats + 1):
                await asyncio.to_thread(_perturb, state)
                started = time.perf_counter()
                manifest = await asyncio.to_thread(store.publish, state)
                out["publish_s"].append(time.perf_counter() - started)
                assert manifest.version == k
                announced = time.time()
                await announce(bus, run, manifest, learner.address)
                first, calls = await first_sample_of(client, prompt, k)
                await asyncio.sleep(0.2)  # the log lines are written
                parts = sync_breakdown(sampler.log(), k, announced, first)
                parts["generate_calls"] = calls
                out["samples"].append(parts)
                shown = ", ".join(
                    f"{p} {v * 1e3:.0f} ms" for p, v in parts.items() if p in PARTS and v
                )
                print(f"{size} v{k}: {shown} ({calls} Generate calls)", flush=True)
    finally:
        sampler.stop()
        await bus.close()
        await learner.stop()
    raw_bw = out["bytes"] / median(out["raw_stream_s"])
    med = {p: median(s[p] for s in out["samples"] if s.get(p) is not None) for p in PARTS}
    med["raw_stream_s"] = median(out["raw_stream_s"])
    med["fetch_alone_s"] = median(out["fetch_alone_s"])
    med["publish_s"] = median(out["publish_s"])
    med["floor_s"] = med["raw_stream_s"] + med["vllm_reload_s"]
    out["median"] = med
    out["raw_stream_bytes_per_s"] = raw_bw
    out["total_vs_floor"] = med["total_s"] / med["floor_s"]
    return out


def _perturb(state: dict[str, Any]) -> None:
    """The next version differs in every float tensor (a trained step would)."""
    for tensor in state.values():
        if tensor.is_floating_point():
            tensor.add_(1e-4)


def print_table(results: dict[str, Any]) -> None:
    header = (
        f"{'model':9} {'MB':>6} {'total':>9} {'fetch':>9} {'gate':>7} {'load':>9} "
        f"{'(vLLM)':>9} {'1st smp':>8} | {'raw strm':>9} {'floor':>9} {'x floor':>8} "
        f"{'fetch alone':>11}"
    )
    print("\nmedian ms per version (announce -> first sample with it)")
    print(header)
    print("-" * len(header))
    for size, r in results.items():
        m = r["median"]

        def ms(key: str, width: int = 9, m: dict = m) -> str:
            value = m.get(key)
            return f"{value * 1e3:{width}.1f}" if value is not None else f"{'-':>{width}}"

        print(
            f"{size:9} {r['bytes'] / 1e6:6.1f} {ms('total_s')} {ms('fetch_s')} "
            f"{ms('gate_wait_s', 7)} {ms('load_s')} {ms('vllm_reload_s')} "
            f"{ms('first_sample_s', 8)} | {ms('raw_stream_s')} {ms('floor_s')} "
            f"{r['total_vs_floor']:7.2f}x {ms('fetch_alone_s', 11)}"
        )
    for size, r in results.items():
        print(
            f"{size}: {r['parameters'] / 1e6:.1f}M params, {r['tensors']} tensors; raw stream "
            f"{r['raw_stream_bytes_per_s'] / 1e6:.0f} MB/s; publish {r['median']['publish_s']:.3f}"
            f" s (not in total); sampler ready in {r['sampler_ready_s']:.1f} s"
        )


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    from services.bus import EmbeddedNats

    nats = EmbeddedNats(WORK_DIR / f"lm_weight_sync-{os.getpid()}" / "nats")
    nats.start()
    try:
        return {size: await run_size(size, a, nats.url) for size in a.sizes}
    finally:
        nats.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "base100m"])
    parser.add_argument("--repeats", type=int, default=5, help="versions per model")
    parser.add_argument("--floor-repeats", type=int, default=3)
    parser.add_argument("--floor-client", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    if a.floor_client:
        address, version, repeats = a.floor_client
        print(json.dumps(asyncio.run(floor_client(address, int(version), int(repeats)))))
        return
    info = machine()
    results = asyncio.run(amain(a))
    print_table(results)
    write_results(a.out, {"machine": info, "repeats": a.repeats, "models": results})


if __name__ == "__main__":
    main()
