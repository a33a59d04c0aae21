"""Settings every learner workload shares: the DeepSpeed engine, the optimizer, the device.

Also the engine knobs (``ZeroStageKnob``, ``PrecisionKnob``, ``DeviceKnob``: type, bounds, help
and check declared once for every learner's settings and job) and ``knob``, which lets a job
reuse a service setting's declaration with one stated difference. Pure pydantic, no torch at
import: the launcher imports this to validate a run before anything starts.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field
from pydantic.fields import FieldInfo

from services.config import StrictModel

__all__ = [
    "SKIP_DEVICE_CHECK_ENV",
    "DeepSpeedSettings",
    "Device",
    "DeviceKnob",
    "NonfiniteGuard",
    "OptimizerSettings",
    "Precision",
    "PrecisionKnob",
    "ZeroStageKnob",
    "check_device",
    "check_precision",
    "knob",
]

Precision = Literal["fp32", "bf16", "fp16"]
Device = Literal["cpu", "cuda", "auto"]
# Set (to anything but "" or "0") to skip the CUDA check, e.g. to validate on a laptop a run
# that will be deployed on GPU machines.
SKIP_DEVICE_CHECK_ENV = "RLFLEET_SKIP_DEVICE_CHECK"


@functools.cache
def _cuda_available() -> bool:
    import torch  # lazily: only a `device: cuda` setting pays for it

    return bool(torch.cuda.is_available())


def check_device(device: str) -> str:
    """``device`` unless it is ``cuda`` on a host without a usable CUDA device (``ValueError``):
    a learner set to ``cuda`` there would crash at every start, so the config fails at once.
    ``auto`` picks whatever is there and is always fine."""
    if device != "cuda" or os.environ.get(SKIP_DEVICE_CHECK_ENV, "") not in ("", "0"):
        return device
    if not _cuda_available():
        raise ValueError(
            "device 'cuda' but this host has no usable CUDA device (torch.cuda.is_available() "
            f"is False); use 'cpu' or 'auto', or set {SKIP_DEVICE_CHECK_ENV}=1 to validate for "
            "another host"
        )
    return device


def check_precision(precision: Precision, device: Device) -> None:
    """``ValueError`` for a precision the device cannot train in."""
    if precision == "fp16" and device == "cpu":
        raise ValueError("precision 'fp16' needs device 'cuda' (DeepSpeed has no CPU fp16)")


# The engine knobs, each declared once for every learner's settings and job; a model gives the
# default by assignment (``zero_stage: ZeroStageKnob = 0``), so that it stays a keyword argument
# with a default for mypy's pydantic plugin.
ZeroStageKnob = Annotated[
    int,
    Field(ge=0, le=3, description="DeepSpeed ZeRO stage of the learner (0: plain data parallel)"),
]
PrecisionKnob = Annotated[
    Precision,
    Field(description="learner training precision (bf16/fp16: mixed precision via DeepSpeed)"),
]
DeviceKnob = Annotated[
    Device,
    AfterValidator(check_device),
    Field(description="learner device (auto: cuda when available)"),
]


def knob(model: type[BaseModel], name: str, **changes: Any) -> Any:
    """The declaration of ``model``'s field ``name`` (type, bounds, help) with ``changes``, e.g.
    ``default=256``: how a model that shares a knob states its one difference instead of
    declaring the knob again. Typed ``Any``, like ``Field``, to stand as any field's default."""
    return FieldInfo.merge_field_infos(model.model_fields[name], **changes)


class NonfiniteGuard(StrictModel):
    """The loop setting every learner's settings share (learner.loop)."""

    # An update whose loss or gradient norm is NaN/inf is skipped: no optimizer step, no weight
    # version, its messages dropped, counted as losses/nonfinite_updates. This many in a row
    # fail the run (a permanent failure, one line naming where their data came from) instead of
    # training on for nothing.
    max_nonfinite_updates: int = Field(default=3, ge=1)


class OptimizerSettings(StrictModel):
    """The client torch.optim.AdamW (no FusedAdam JIT build); eps 1e-5 as CleanRL."""

    lr: float = Field(default=2.5e-4, gt=0)
    eps: float = Field(default=1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)  # 0: AdamW == Adam, as in CleanRL
    # torch's fused AdamW kernel (one call per parameter rather than a dozen tensor ops): the
    # same update to rounding, in a fraction of the time for a small policy on CPU. False:
    # torch's per-parameter loop.
    fused: bool = True


class DeepSpeedSettings(StrictModel):
    """What learner.engine turns into a DeepSpeed config."""

    zero_stage: ZeroStageKnob = 0
    precision: PrecisionKnob = "fp32"
    gradient_clipping: float | None = Field(default=0.5, gt=0)  # global grad-norm clip; None = off
    train_micro_batch_size: int = Field(default=128, ge=1)  # rows per backward (the minibatch)
    device: DeviceKnob = "auto"
    # Where JIT-built ops (the CPU shared-memory comm op, 40-50 s to build once) are cached:
    # TORCH_EXTENSIONS_DIR = <cache_dir>/torch_extensions unless that variable is set already.
    # None: $RLFLEET_CACHE_DIR, else $XDG_CACHE_HOME/rlfleet, else ~/.cache/rlfleet.
    cache_dir: Path | None = None
