"""Shared pieces of the language-model benchmarks (bench/lm/, bench/serving/): local models,
arith prompts, a sampler process started as deployed (``python -m launch.cli serve
sampler``), its log parsed for timings, the learner's weight server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._shared.results import ROOT, WORK_DIR


def model_dir(size: str) -> Path:
    """A local Qwen2 model of ``size`` (common.models), created on first use."""
    from common.models import init_model

    path = WORK_DIR / "models" / f"{size}-arith"
    if not (path / "config.json").is_file():
        print(f"creating the {size} model in {path} ...", flush=True)
        init_model(path, size=size)
    return path


def model_parameters(path: Path) -> int:
    return int(json.loads((path / "rlfleet_model.json").read_text())["parameters"])


def arith_tasks(count: int, seed: int = 0) -> list[Any]:
    """``count`` arith tasks ("Q: 3+4=?\\nA:", answer in extra)."""
    from common.datasets import iter_tasks, take

    return take(iter_tasks({"generator": "arith", "seed": seed}), count)


def vllm_environment(run_dir: Path, kv_cache_gib: int = 1) -> dict[str, str]:
    """What sampler/lm/service.configure_environment sets before vLLM starts (the compile cache
    shared by runs, the temp folder under the run directory, no usage stats, offline; a bench
    measuring a cold start passes compile_cache="run" to its sampler); applied to this
    process's os.environ as well, so an in-process engine sees the same."""
    from sampler.lm.service import configure_environment
    from sampler.lm.settings import SamplerSettings

    settings = SamplerSettings(model_path="unused", kv_cache_gib=kv_cache_gib)
    configure_environment(run_dir, settings)
    keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS", "HF_HUB_OFFLINE", "VLLM_CACHE_ROOT")
    keys += ("TORCHINDUCTOR_CACHE_DIR", "TMPDIR")
    return {k: os.environ[k] for k in keys if k in os.environ}


# --------------------------------------------------------------------------- service logs

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\w+) (\S+) (\S+): (.*)$")


@dataclass(frozen=True)
class LogLine:
    time: float  # time.time() seconds (the log's millisecond resolution)
    level: str
    logger: str
    message: str


def read_log(path: Path) -> list[LogLine]:
    """The lines of a service log written with services.serve's format."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m:
            stamp = time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1e3
            out.append(LogLine(stamp, m[3], m[5], m[6]))
    return out


def find_log(lines: list[LogLine], pattern: str) -> tuple[LogLine, re.Match[str]] | None:
    """The first line whose message matches ``pattern`` (re.search)."""
    rx = re.compile(pattern)
    for line in lines:
        m = rx.search(line.message)
        if m:
            return line, m
    return None


# --------------------------------------------------------------------------- sampler process


class SamplerProcess:
    """``python -m launch.cli serve sampler`` on a free loopback port, settings by
    RLFLEET_SAMPLER__* variables, log to ``<run_dir>/<name>.log``."""

    def __init__(
        self,
        model: Path,
        run_dir: Path,
        *,
        name: str = "sampler",
        run: str = "bench",
        nats_url: str | None = None,
        weights_from: str | None = None,
        settings: Mapping[str, Any] | None = None,
        omp_threads: int | None = None,
        cpus: list[int] | None = None,
    ) -> None:
        from services.placement import ENV_CPUS, format_cpus
        from services.ports import free_port

        self.run_dir = run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = run_dir / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
        env.update(
            RLFLEET_RUN_NAME=run,
            RLFLEET_RUN_DIR=str(run_dir),
            RLFLEET_LOG_LEVEL="INFO",
            RLFLEET_SAMPLER__MODEL_PATH=str(model),
            PYTHONPATH=str(ROOT),
        )
        if omp_threads is not None:
            env["OMP_NUM_THREADS"] = str(omp_threads)
        if cpus:  # as `rlfleet up` places it
            env[ENV_CPUS] = format_cpus(cpus)
        if nats_url:
            env["RLFLEET_NATS_URL"] = nats_url
        if weights_from:
            env["RLFLEET_SAMPLER__WEIGHTS_FROM"] = weights_from
        for key, value in (settings or {}).items():
            env[f"RLFLEET_SAMPLER__{key.upper()}"] = json.dumps(value)
        cmd = [sys.executable, "-m", "launch.cli", "serve", "sampler", "--name", name]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.started = time.time()
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.ready_s: float | None = None

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Seconds from the process start to health SERVING (engine up, first weights in)."""
        from services.server import wait_for_health

        try:
            wait_for_health(self.address, timeout_s=timeout_s)
        except BaseException:
            self.stop()
            print(self.log_path.read_text()[-4000:], file=sys.stderr)
            raise
        self.ready_s = time.time() - self.started
        return self.ready_s

    def log(self) -> list[LogLine]:
        self._log.flush()
        return read_log(self.log_path)

    def engine_start_s(self) -> float | None:
        """What the engine logged: 'vLLM <path> started in X s'."""
        found = find_log(self.log(), r"vLLM .* started in ([\d.]+)s")
        return float(found[1][1]) if found else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def service_process(
    kind: str, run_dir: Path, name: str, timeout_s: float = 120.0
) -> tuple[subprocess.Popen, str]:
    """``python -m launch.cli serve KIND`` on a free port, healthy; (process, address). Its
    log is ``<run_dir>/<name>.log``."""
    from services.ports import free_port
    from services.server import wait_for_health

    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    env.update(OMP_NUM_THREADS="1", RLFLEET_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT))
    log = open(run_dir / f"{name}.log", "w")  # noqa: SIM115 - inherited by the child
    cmd = [sys.executable, "-m", "launch.cli", "serve", kind, "--name", name]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout_s=timeout_s)
    except BaseException:
        proc.kill()
        raise
    return proc, f"127.0.0.1:{port}"


def reward_service_process(run_dir: Path, name: str = "reward") -> tuple[subprocess.Popen, str]:
    """A reward service (service_process)."""
    return service_process("reward_service", run_dir, name)


def stop_process(
    proc: subprocess.Popen, sig: int = signal.SIGTERM, *, group: bool = False, wait_s: float = 30
) -> None:
    """``sig`` to the process (its whole group with ``group``: one started with
    ``start_new_session``), then SIGKILL if it is not gone within ``wait_s``."""
    if proc.poll() is not None:
        return
    send = (lambda s: os.killpg(proc.pid, s)) if group else proc.send_signal
    send(sig)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


# --------------------------------------------------------------------------- weight versions


async def start_weight_server(run: str, keep: int = 2, raw_stream: bool = False) -> tuple[Any, Any]:
    """The learner side of weight sync in this process: (WeightStore, started GrpcServer with
    the WeightService and, with ``raw_stream``, bench/transport/weight_sync.py's bare byte
    stream)."""
    from learner.weights import SERVICE_NAME, WeightServicer, WeightStore, add_weight_service
    from services.server import GrpcServer

    store = WeightStore(run, keep=keep)
    server = GrpcServer(f"bench-learner-{run}", grace_s=0.5)
    server.add_service(add_weight_service, WeightServicer(store), SERVICE_NAME)
    if raw_stream:
        from bench.transport.weight_sync import RAW_SERVICE, raw_handler

        server.add_service(
            lambda _, grpc_server: grpc_server.add_generic_rpc_handlers((raw_handler(store),)),
            None,
            RAW_SERVICE,
        )
    await server.start()
    server.set_serving()
    return store, server


async def first_sample_of(
    client: Any, prompt: list[int], version: int, timeout_s: float = 600.0
) -> tuple[float, int]:
    """Call Generate (1 prompt, 1 token) back to back until a completion carries ``version``;
    (time.time() when that reply arrived, number of calls)."""
    deadline = time.monotonic() + timeout_s
    calls = 0
    while True:
        reply = await client.generate([prompt], n=1, max_tokens=1, temperature=1.0)
        calls += 1
        got = reply.results[0].completions[0].policy_version
        if got == version:
            return time.time(), calls
        if got > version:
            raise RuntimeError(f"the sampler skipped version {version} (serves {got})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} not served within {timeout_s:g}s")


def sync_breakdown(
    lines: list[LogLine], version: int, announced: float, first: float
) -> dict[str, float | None]:
    """Seconds of each part of one version's trip, from the sampler's log and this process's
    clock (same machine): notify + fetch (announce -> 'fetched weights vK'), gate wait (until
    the load began), load ('serving weights vK (loaded in X ms)'; of which vLLM's
    reload_weights + prefix-cache reset, 'vLLM: weights vK loaded ... in X ms'), first sample
    (served -> the first reply with vK)."""
    fetched = find_log(lines, rf"^fetched weights v{version} from")
    served = find_log(lines, rf"^serving weights v{version} \(loaded in (\d+) ms\)")
    reload = find_log(lines, rf"^vLLM: weights v{version} loaded \((\d+) tensors\) in (\d+) ms")
    out: dict[str, float | None] = {"total_s": first - announced}
    if fetched is None or served is None:
        return out
    load_s = int(served[1][1]) / 1e3
    load_began = served[0].time - load_s
    out.update(
        fetch_s=fetched[0].time - announced,
        gate_wait_s=max(0.0, load_began - fetched[0].time),
        load_s=load_s,
        vllm_reload_s=int(reload[1][2]) / 1e3 if reload else None,
        first_sample_s=first - served[0].time,
    )
    return out
