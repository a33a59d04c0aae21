"""Settings every learner workload shares: the DeepSpeed engine, the optimizer, the device.

Pure pydantic, no torch at import: the launcher imports this to validate a run before anything
starts.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from services.config import StrictModel

__all__ = [
    "SKIP_DEVICE_CHECK_ENV",
    "DeepSpeedSettings",
    "Device",
    "OptimizerSettings",
    "Precision",
    "check_device",
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


class OptimizerSettings(StrictModel):
    """The client torch.optim.AdamW (no FusedAdam JIT build); eps 1e-5 as CleanRL."""

    lr: float = Field(default=2.5e-4, gt=0)
    eps: float = Field(default=1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)  # 0: AdamW == Adam, as in CleanRL
    # torch's fused AdamW kernel (one call per parameter rather than ~10 tensor ops): the same
    # update to rounding, its step 4-5x faster for a small policy on CPU (CartPole's MLP:
    # ~90 against ~410 us, a tenth of the PPO update). False: torch's per-parameter loop.
    fused: bool = True


class DeepSpeedSettings(StrictModel):
    """What learner.engine turns into a DeepSpeed config."""

    zero_stage: int = Field(default=0, ge=0, le=3)
    precision: Precision = "fp32"
    gradient_clipping: float | None = Field(default=0.5, gt=0)  # global grad-norm clip; None = off
    train_micro_batch_size: int = Field(default=128, ge=1)  # rows per backward (the minibatch)
    device: Device = "auto"
    # Where JIT-built ops (the CPU shared-memory comm op, 40-50 s to build once) are cached:
    # TORCH_EXTENSIONS_DIR = <cache_dir>/torch_extensions unless that variable is set already.
    # None: $RLFLEET_CACHE_DIR, else $XDG_CACHE_HOME/rlfleet, else ~/.cache/rlfleet.
    cache_dir: Path | None = None

    @field_validator("device")
    @classmethod
    def _available_device(cls, device: Device) -> Device:
        check_device(device)
        return device
