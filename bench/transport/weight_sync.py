"""Weight sync: publish and fetch latency through a real WeightService, next to the floors.

The learner side (WeightStore + WeightService + a raw-bytes stream service) runs in its own
process, as it does in a run; this process is the sampler. For each tensor set:

- publish: ``WeightStore.publish(state_dict)`` (snapshot copy + SHA-256 per tensor), in the
  server process, into fresh memory and (``publish reuse``) into an evicted version's buffer;
- fetch cold / warm: ``common.weights.fetch_weights`` of one version (manifest, stream, CRC per
  chunk, SHA-256 per tensor, tensors rebuilt); cold is the first fetch of a version (the server
  computes and caches the chunk CRCs), warm a later one (what every other sampler sees);
- floors: ``memcpy``, the bytes copied once (numpy copyto, measured here), and ``raw stream``, the
  same bytes in the same chunks over a bare grpc unary-stream with no protobuf, no
  checksums and nothing done with the data on arrival.

Tensor sets: the CartPole actor-critic (two 4-64-64 tanh MLPs, common/policies.py defaults)
and about 100M fp32 parameters (24 Linear(2048, 2048) layers, 403 MB).

    python -m bench.transport.weight_sync      # both sets, 3 repeats
    python -m bench.transport.weight_sync --sets tiny --repeats 5

Prints a table and writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from bench._shared.results import RESULTS_DIR, ROOT, results_json
from clients.learner import fetch_weights
from common.weights import chunk_spans
from learner.weights import SERVICE_NAME, WeightServicer, WeightStore, add_weight_service
from services.server import GrpcServer, channel

RESULTS = RESULTS_DIR / "weight_sync.json"
RAW_SERVICE = "rlfleet.bench.v1.RawStream"
RAW_METHOD = f"/{RAW_SERVICE}/Fetch"


def tensor_set(name: str) -> dict[str, torch.Tensor]:
    """The named set's state_dict, deterministic."""
    torch.manual_seed(0)
    if name == "tiny":

        def mlp(out: int) -> torch.nn.Sequential:
            return torch.nn.Sequential(
                torch.nn.Linear(4, 64), torch.nn.Tanh(),
                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                torch.nn.Linear(64, out),
            )  # fmt: skip

        model = torch.nn.ModuleDict({"actor": mlp(2), "critic": mlp(1)})
    elif name == "100m":
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])
    else:
        raise SystemExit(f"unknown tensor set {name!r}")
    return {k: v.detach() for k, v in model.state_dict().items()}


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Best time to copy ``nbytes`` once (both buffers already touched)."""
    src = np.ones(max(nbytes, 1), dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


# --------------------------------------------------------------------------- server process


def raw_handler(store: WeightStore) -> grpc.GenericRpcHandler:
    """A bare unary-stream: version number in, the version's bytes out, in the same chunks as
    FetchWeights (at most 2 MiB, one tensor each) but without protobuf or checksums."""

    async def fetch(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        entry = store.get(int(request))
        for _, start, stop in chunk_spans(entry.manifest):
            yield entry.payload[start:stop].tobytes()

    handlers = {"Fetch": grpc.unary_stream_rpc_method_handler(fetch)}
    return grpc.method_handlers_generic_handler(RAW_SERVICE, handlers)


async def serve(name: str, repeats: int) -> None:
    """Publish the set ``repeats`` times, report on stdout, serve until stdin closes.

    Publish is timed twice: into the store that serves (every version in fresh memory, as a
    learner's first versions) and into a ``keep=1`` store whose later versions reuse an evicted
    version's buffer (a learner's steady state).
    """
    state = tensor_set(name)
    store = WeightStore(name, keep=repeats)
    steady = WeightStore(name, keep=1)
    fresh, recycled = [], []
    for i in range(repeats + 2):
        if i < repeats:
            start = time.perf_counter()
            store.publish(state)  # directly: nothing else runs on this loop yet
            fresh.append(time.perf_counter() - start)
        start = time.perf_counter()
        steady.publish(state)
        if i >= 2:  # versions 0 and 1 had no evicted buffer to reuse yet
            recycled.append(time.perf_counter() - start)
        for tensor in state.values():  # training goes on: the next version differs
            tensor.add_(1.0)
    del steady
    manifest = store.get().manifest
    report = {
        "publish_s": fresh,
        "publish_recycled_s": recycled,
        "total_bytes": manifest.total_bytes,
        "num_tensors": len(manifest.tensors),
        "memcpy_s": memcpy_seconds(manifest.total_bytes),
    }
    server = GrpcServer("bench-learner")
    server.add_service(add_weight_service, WeightServicer(store), SERVICE_NAME)
    server.add_service(
        lambda _, grpc_server: grpc_server.add_generic_rpc_handlers((raw_handler(store),)),
        None,
        RAW_SERVICE,
    )
    async with server:
        server.set_serving()
        print(json.dumps({"port": server.port, "report": report}), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the parent closes the pipe


# --------------------------------------------------------------------------- client side


async def raw_stream(chan: grpc.aio.Channel, version: int) -> int:
    received = 0
    async for raw in chan.unary_stream(RAW_METHOD)(str(version).encode(), timeout=600):
        received += len(raw)
    return received


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of this process or of ``pid`` (Linux /proc, in
    clock ticks: 10 ms resolution).

    Reported next to wall time: the build machines are shared, and CPU time varies far less
    with the neighbours' load than wall time does.
    """
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    port: int, server_pid: int, info: dict[str, Any], repeats: int
) -> dict[str, list[float]]:
    """Wall, client CPU and server CPU seconds of each kind of transfer, ``repeats`` times."""
    out: dict[str, list[float]] = {}

    async def timed(kind: str, transfer: Any) -> None:
        wall, cpu, server = time.perf_counter(), process_cpu_s(), process_cpu_s(server_pid)
        await transfer
        out.setdefault(f"{kind}_s", []).append(time.perf_counter() - wall)
        out.setdefault(f"{kind}_client_cpu_s", []).append(process_cpu_s() - cpu)
        out.setdefault(f"{kind}_server_cpu_s", []).append(process_cpu_s(server_pid) - server)

    async def fetch(version: int) -> None:
        manifest, _ = await fetch_weights(chan, version)
        assert manifest.total_bytes == info["total_bytes"]

    async def raw(version: int) -> None:
        assert await raw_stream(chan, version) == info["total_bytes"]

    async with channel(f"127.0.0.1:{port}") as chan:
        for version in range(repeats):
            await timed("fetch_cold", fetch(version))
            await timed("fetch_warm", fetch(version))
            await timed("raw_stream", raw(version))
    return out


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f} ms"


def _mb_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:8.0f} MB/s" if nbytes else "       - MB/s"


def print_table(results: dict[str, Any]) -> None:
    header = (
        f"{'set':6} {'what':14} {'median':>12} {'throughput':>13} {'vs raw':>7} "
        f"{'client CPU':>12} {'server CPU':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        n, median = r["total_bytes"], r["median"]
        for key, label in (
            ("memcpy", "memcpy"),
            ("raw_stream", "raw stream"),
            ("publish", "publish"),
            ("publish_recycled", "publish reuse"),
            ("fetch_cold", "fetch cold"),
            ("fetch_warm", "fetch warm"),
        ):
            s = median[f"{key}_s"]
            ratio = f"{median['raw_stream_s'] / s:6.2f}x" if key.startswith("fetch") else ""
            cpu = "".join(
                f" {_fmt_s(median[f'{key}_{side}_cpu_s'])}"
                if f"{key}_{side}_cpu_s" in median
                else f" {'':12}"
                for side in ("client", "server")
            )
            print(f"{name:6} {label:14} {_fmt_s(s)} {_mb_s(n, s)} {ratio:>7}{cpu}")
        print(f"{'':6} {n} bytes in {r['num_tensors']} tensors")


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "grpcio": metadata.version("grpcio"),
        "protobuf": metadata.version("protobuf"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def run_set(name: str, repeats: int) -> dict[str, Any]:
    """Start a learner process for one set, measure from here, stop it."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", __spec__.name, "--serve", "--repeats", str(repeats)]
    server = subprocess.Popen(
        [*cmd, "--sets", name], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"learner process exited with {server.wait()}")
        hello = json.loads(line)
        timings = asyncio.run(measure(hello["port"], server.pid, hello["report"], repeats))
        result = {**hello["report"], **timings}
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)
    result["median"] = {
        k: statistics.median(v) if isinstance(v, list) else v
        for k, v in result.items()
        if k.endswith("_s")
    }
    median = result["median"]
    result["fetch_warm_vs_raw_stream"] = median["raw_stream_s"] / median["fetch_warm_s"]
    result["fetch_cold_vs_raw_stream"] = median["raw_stream_s"] / median["fetch_cold_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=["tiny", "100m"], choices=["tiny", "100m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.sets[0], args.repeats))
        return

    results = {name: run_set(name, args.repeats) for name in args.sets}
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(results_json({"machine": machine(), "sets": results}))
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
