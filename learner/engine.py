"""A DeepSpeed engine around a policy module, set up for a plain ``python`` process as well as
under ``torchrun`` / the ``deepspeed`` launcher.

What this adds to ``deepspeed.initialize`` (see docs/platform.md, "DeepSpeed 0.19.8 on CPU"):

- the distributed environment a single process needs (RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT on a free port); without it DeepSpeed tries MPI discovery;
- the accelerator (``DS_ACCELERATOR``) chosen from ``device`` before DeepSpeed is imported;
- a client ``torch.optim.AdamW`` (naming the optimizer in the config JIT-builds CPU FusedAdam);
- ``TORCH_EXTENSIONS_DIR`` under a persistent cache: the first ``deepspeed.initialize`` on a
  machine JIT-compiles the CPU shared-memory comm op (slow), later ones load it from there.
  Call ``warm_up()`` (``python -m learner.engine``) once per machine or image to pay that
  outside any run;
- full named weights, gathered under ZeRO-3; checkpoints with client state; a per-update
  learning rate; and ``close()``, which destroys the process group and removes the shared-memory
  buffer files the comm op created;
- ``check_step``: between backward and the optimizer step, a loss or global gradient norm that
  is NaN/inf on any rank drops the gradients and raises ``NonfiniteUpdate``, so no such step is
  ever applied (one NaN step makes every weight NaN, and every version after it).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from learner import safe_load
from learner.settings import DeepSpeedSettings, OptimizerSettings
from services.cache import user_cache_dir
from services.errors import InvalidArgument
from services.ports import free_port

__all__ = [
    "Engine",
    "NonfiniteUpdate",
    "TrainEngine",
    "build_engine",
    "cache_dir",
    "check_step",
    "deepspeed_config",
    "warm_up",
]

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHM_DIR = Path("/dev/shm")
_open_engines = 0  # engines sharing this process's process group
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_saved_env: dict[str, str | None] | None = None  # what _DIST_VARS were before we set them


def cache_dir(configured: Path | None = None) -> Path:
    """The persistent cache (JIT-built ops): configured, else services.cache.user_cache_dir."""
    if configured is not None:
        return Path(configured).expanduser()
    return user_cache_dir()


def _launched() -> bool:
    """True under torchrun / the deepspeed launcher / MPI (they set the rank variables)."""
    return _saved_env is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _prepare_environment(settings: DeepSpeedSettings) -> str:
    """Set the process environment DeepSpeed reads; returns the device type ("cpu"/"cuda")."""
    global _saved_env
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    os.environ.setdefault("DS_ACCELERATOR", device)
    if os.environ["DS_ACCELERATOR"] != device:
        raise RuntimeError(
            f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} conflicts with device '{device}'"
        )
    extensions = cache_dir(settings.cache_dir) / "torch_extensions"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions))
    Path(os.environ["TORCH_EXTENSIONS_DIR"]).mkdir(parents=True, exist_ok=True)
    if not _launched() and not torch.distributed.is_initialized():
        if _saved_env is None:
            _saved_env = {name: os.environ.get(name) for name in _DIST_VARS}
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    return device


def _restore_environment() -> None:
    """Undo _prepare_environment's rank variables, so child processes (and the next engine) do
    not take this process's stale MASTER_PORT for a launcher's."""
    global _saved_env
    if _saved_env is None:
        return
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env = None


def deepspeed_config(settings: DeepSpeedSettings) -> dict[str, Any]:
    """The DeepSpeed config dict for ``settings`` (one process: no gradient accumulation)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": settings.train_micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": settings.train_micro_batch_size * world,
        "gradient_clipping": settings.gradient_clipping or 0.0,
        "zero_optimization": {"stage": settings.zero_stage},
        "steps_per_print": 2**62,  # no periodic log lines
        "wall_clock_breakdown": False,
    }
    if settings.zero_stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if settings.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif settings.precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config


class TrainEngine(Protocol):
    """What an LM update step (learner.lm.update, learner.lm.sft) needs of its engine: an
    ``Engine``, or a plain module + optimizer (tests). Called like the model, keywords only
    (``engine(input_ids=..., attention_mask=...)``)."""

    def __call__(self, **kwargs: Any) -> Any: ...
    def set_lr(self, lr: float) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> None: ...
    def accumulation_boundary(self, last: bool) -> None: ...


class Engine:
    """A built DeepSpeed engine. Call it like the module (``engine(obs, actions)``); then
    ``backward(loss)`` and ``step()``."""

    def __init__(self, ds_engine: Any, settings: DeepSpeedSettings, init_s: float) -> None:
        self.ds = ds_engine
        self.settings = settings
        self.init_s = init_s  # seconds deepspeed.initialize took (JIT build included)
        self.dtype = _DTYPES[settings.precision]  # parameter dtype
        self.device = torch.device(ds_engine.device)
        # Data-parallel place: each rank trains on its shard of every minibatch (learner.game).
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world_size = (
            torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        )
        # One fp32 rank without ZeRO or DeepSpeed's clipping: DeepSpeed's forward, backward and
        # step then do what the module, ``loss.backward()`` and the optimizer do, plus hooks,
        # timers and bookkeeping that weigh on a small policy's update
        # (bench/game/ppo_update_profile.py). ``direct`` makes those calls itself, with the same
        # arithmetic (the same bits) and the engine's step counters advanced as DeepSpeed would.
        self.direct = (
            settings.zero_stage == 0
            and self.dtype == torch.float32
            and self.world_size == 1
            and not ds_engine.gradient_clipping()
            and ds_engine.gradient_accumulation_steps() == 1
            and ds_engine.lr_scheduler is None
        )
        self._closed = False

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.direct:
            return self.ds.module(*args, **kwargs)
        with self.autocast():
            return self.ds(*args, **kwargs)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Mixed-precision region for bf16/fp16 parameters (inputs stay fp32 in the policy)."""
        if self.dtype == torch.float32:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        if self.direct:
            loss.backward()  # DeepSpeed's divides by gradient_accumulation_steps, here 1
        else:
            self.ds.backward(loss)

    def step(self) -> None:
        """Optimizer step (clips gradients first) and zero the gradients."""
        if not self.direct:
            self.ds.step()
            # ZeRO 1/2 keep gradients in their partitions, where check_step cannot see them; such
            # a step DeepSpeed skips itself on a non-finite norm (fp16 skips are loss scaling).
            if self.dtype != torch.float16 and not self.ds.was_step_applied():
                raise NonfiniteUpdate("DeepSpeed skipped a step: the gradient norm is not finite")
            return
        ds = self.ds
        ds.optimizer.step()
        ds.optimizer.zero_grad(set_to_none=True)  # DeepSpeed's zero_grad: every grad to None
        ds.global_steps += 1  # what its checkpoints record
        ds.global_samples += ds.train_batch_size()

    def drop_gradients(self) -> None:
        """Forget the gradients of a step that will not be taken (see ``check_step``)."""
        for param in self.ds.module.parameters():
            param.grad = None
        optimizer = self.ds.optimizer
        optimizer.zero_grad(set_to_none=True)
        # ZeRO 1/2 reduce into these; DeepSpeed's own overflow branch clears them the same way.
        for name in ("averaged_gradients", "all_grad_tensors"):
            held = getattr(optimizer, name, None)
            if isinstance(held, dict):
                for key in held:
                    held[key] = None

    def accumulation_boundary(self, last: bool) -> None:
        """Whether the next ``backward`` ends an optimizer step's micro-batches. Before it,
        gradients only accumulate: under ZeRO 1 and 2 DeepSpeed would otherwise reduce and
        partition them after every backward, which sums them wrongly. The config has
        ``gradient_accumulation_steps`` 1, so ``backward`` does not rescale the loss."""
        self.ds.set_gradient_accumulation_boundary(last)

    @property
    def lr(self) -> float:
        return float(self.ds.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (annealing, once per update)."""
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full tensors by state_dict name, on the CPU, gathered under ZeRO-3 (every rank must
        call this). ``dtype`` casts floating-point tensors (default: the parameter dtype)."""
        module = self.module
        params = list(module.parameters())
        gather: Any = contextlib.nullcontext()
        if self.settings.zero_stage == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        out: dict[str, torch.Tensor] = {}
        with gather, torch.no_grad():
            for name, tensor in module.state_dict(keep_vars=True).items():
                value = tensor.detach()
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                out[name] = value.to("cpu", copy=True).contiguous()
        return out

    def save(
        self, directory: Path, tag: str, client_state: dict[str, Any], *, keep: int | None = None
    ) -> Path:
        """Write a DeepSpeed checkpoint ``directory/tag`` (model, optimizer, ``client_state``)
        and point ``directory/latest`` at it; then delete all but the newest ``keep`` tags."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.ds.save_checkpoint(str(directory), tag=tag, client_state=client_state)
        if keep is not None and self.ds.global_rank == 0:
            _prune(directory, keep, current=tag)
        return directory / tag

    def load(self, directory: Path, tag: str | None = None) -> dict[str, Any] | None:
        """Restore model and optimizer from ``directory`` (tag None: the ``latest`` one); returns
        the client state, or None when there is no checkpoint to load."""
        directory = Path(directory)
        if tag is None and not (directory / "latest").is_file():
            return None
        safe_load.install(self.ds)  # weights_only=True: a checkpoint cannot run code
        path, client_state = self.ds.load_checkpoint(str(directory), tag=tag)
        if path is None:
            return None
        log.info("restored checkpoint %s", path)
        return dict(client_state or {})

    def close(self) -> None:
        """Destroy the process group (when no other engine of this process uses it) and remove
        the shared-memory buffer this rank's comm op created. Idempotent."""
        global _open_engines
        if self._closed:
            return
        self._closed = True
        _open_engines -= 1
        if _open_engines > 0:
            return
        shm = _shm_buffer_path()
        if torch.distributed.is_initialized():
            import deepspeed.comm

            # DeepSpeed's version also drops its cached groups, so a later engine can start over.
            deepspeed.comm.destroy_process_group()
        if shm is not None:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        _restore_environment()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NonfiniteUpdate(InvalidArgument):
    """An update stopped before an optimizer step whose loss or gradients were NaN/inf (on any
    rank): that step was not taken and its gradients were dropped. The learner loop skips the
    update (no version), and fails the run after ``max_nonfinite_updates`` in a row."""

    def __init__(self, message: str, *, metrics: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.metrics = dict(metrics or {})  # the update's values so far (NaN ones included)
        self.sources: list[str] = []  # where the update's data came from, filled by a workload


def check_step(engine: Any, loss: torch.Tensor) -> None:
    """Between ``engine.backward(loss)`` and ``engine.step()``: raise NonfiniteUpdate, with the
    gradients dropped, when the loss or the global gradient norm is NaN/inf on any rank. Every
    rank decides the same (one all-reduce with several ranks), so they never part ways.

    ``engine``: an ``Engine`` or any TrainEngine with a ``module`` (plain test engines)."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    loss_value = loss.detach().float().reshape(-1)[0]
    if grads:
        norm_value = torch.stack(torch._foreach_norm(grads, 2.0)).norm().float()
    else:  # ZeRO 1/2 after the boundary: DeepSpeed's step checks the partitions (Engine.step)
        norm_value = torch.zeros((), device=loss_value.device)
    norm_value = norm_value.to(loss_value.device)
    finite = torch.isfinite(loss_value) & torch.isfinite(norm_value)
    world = int(getattr(engine, "world_size", 1))
    if world > 1:
        import torch.distributed as dist

        flag = finite.to(device=engine.device, dtype=torch.float32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # the process group DeepSpeed set up
        finite = flag[0] > 0
    if bool(finite):
        return
    if hasattr(engine, "drop_gradients"):
        engine.drop_gradients()
    else:
        for param in engine.module.parameters():
            param.grad = None
    loss_f, norm_f = float(loss_value), float(norm_value)
    if math.isfinite(loss_f) and math.isfinite(norm_f):
        what = "another rank's loss or gradient norm is not finite"
    else:
        what = f"loss {loss_f}, gradient norm {norm_f}"
    raise NonfiniteUpdate(what)


def _shm_buffer_path() -> Path | None:
    """The buffer DeepSpeed's CPU comm op creates when all ranks are local (LOCAL_SIZE set):
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``."""
    env = os.environ
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{env['MASTER_ADDR']}_{env['MASTER_PORT']}"
        f"_{env.get('RANK', '0')}"
    )
    return _SHM_DIR / name


def _prune(directory: Path, keep: int, current: str) -> None:
    tags = sorted(
        (p for p in directory.iterdir() if p.is_dir() and p.name != current),
        key=lambda p: p.stat().st_mtime,
    )
    for old in tags[: max(0, len(tags) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _shm_op_built() -> bool:
    """The CPU shared-memory comm op is in the JIT cache already (``warm_up`` built it)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ""))
    return any(root.glob("deepspeed_shm_comm*/*.so"))


def _skip_shm_op_unless_built() -> None:
    """DeepSpeed builds the CPU shared-memory all-reduce op on every first init of a machine
    (a long g++ build). With one process it has nothing to speed up, and with several a first
    start should not wait for a compiler: skip it then (DeepSpeed falls back to
    torch.distributed, as when the op is missing); ranks use it once ``warm_up`` built it."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1 and _shm_op_built():
        return
    try:  # (`from deepspeed.comm import torch` would find the torch package re-exported there)
        ds_comm_torch: Any = importlib.import_module("deepspeed.comm.torch")  # patched below
    except ImportError:  # layout changed: just build it
        return
    if hasattr(ds_comm_torch, "build_shm_op"):
        ds_comm_torch.build_shm_op = lambda: None


def preload_engine(ds_cfg: DeepSpeedSettings) -> None:
    """Import what ``build_engine`` imports, ahead of the run: DeepSpeed's modules, in the
    environment it sets for ``ds_cfg`` (DeepSpeed picks its accelerator once, from
    DS_ACCELERATOR, as soon as it is imported), and torch._dynamo, which torch.optim imports
    as the first optimizer is made."""
    import torch._dynamo  # noqa: F401

    _prepare_environment(ds_cfg)
    try:
        import deepspeed  # noqa: F401

        _skip_shm_op_unless_built()
    finally:
        _restore_environment()


def build_engine(
    model: nn.Module, optimizer_cfg: OptimizerSettings, ds_cfg: DeepSpeedSettings
) -> Engine:
    """Wrap ``model`` (its ``forward`` is what ``engine(...)`` calls) in a DeepSpeed engine with a
    client AdamW. The first call on a machine may be slow (JIT comm op); see ``warm_up``."""
    global _open_engines
    device = _prepare_environment(ds_cfg)
    import deepspeed

    if ds_cfg.zero_stage == 3 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Gathering ZeRO-3 weights is collective; the ranks' protocol (learner.ranks) does not
        # run it on every rank, so several ranks train with stages 0-2 (full weights each).
        raise ValueError("several learner ranks need zero_stage 0, 1 or 2 (not 3)")
    _skip_shm_op_unless_built()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    optimizer = torch.optim.AdamW(
        # Frozen parameters (LoRA's base weights, a frozen vision encoder) hold no optimizer
        # state and are never stepped.
        [p for p in model.parameters() if p.requires_grad],
        lr=optimizer_cfg.lr,
        betas=optimizer_cfg.betas,
        eps=optimizer_cfg.eps,
        weight_decay=optimizer_cfg.weight_decay,
        fused=optimizer_cfg.fused,
    )
    start = time.perf_counter()
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(ds_cfg)
    )
    init_s = time.perf_counter() - start
    if ds_cfg.zero_stage == 0 and torch.distributed.get_world_size() == 1:
        # An all-reduce over one rank is the identity, yet DeepSpeed still flattens, copies and
        # reduces every gradient each step, a real share of a small model's update.
        ds_engine.enable_backward_allreduce = False
    _open_engines += 1
    log.info(
        "DeepSpeed engine ready in %.1f s (device %s, ZeRO %d, %s)",
        init_s,
        device,
        ds_cfg.zero_stage,
        ds_cfg.precision,
    )
    return Engine(ds_engine, ds_cfg, init_s)


def warm_up(settings: DeepSpeedSettings | None = None) -> float:
    """JIT-build the CPU shared-memory comm op into the cache (what a multi-process CPU run's
    first init would otherwise spend its time on; single processes skip it) and check that an
    engine builds. Returns the seconds it took; run it once per machine or image."""
    settings = settings or DeepSpeedSettings(device="cpu")
    start = time.perf_counter()
    device = _prepare_environment(settings)
    if device == "cpu":
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            builder.load()
    with build_engine(nn.Linear(2, 1), OptimizerSettings(), settings):
        pass
    return time.perf_counter() - start


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(f"DeepSpeed warm-up took {warm_up():.1f} s (cache: {os.environ['TORCH_EXTENSIONS_DIR']})")
