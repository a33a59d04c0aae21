"""Loading checkpoints without running code from them: `torch.load(weights_only=True)`.

A pickle can run anything; a checkpoint folder is as easy to swap as any file. DeepSpeed's own
checkpoint engine loads with ``weights_only=False``, so the learner replaces it with
`SafeCheckpointEngine`, which allows only tensors, containers, numbers, strings and the few
classes rlfleet's and DeepSpeed's checkpoints really hold (listed in `SAFE_GLOBALS`, found with
`torch.serialization.get_unsafe_globals_in_checkpoint` on ZeRO 0-3 game and LM checkpoints).
A checkpoint holding anything else fails to load with an error naming the class.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

__all__ = ["SAFE_GLOBALS", "install", "safe_load", "verify_checkpoint"]


def _safe_globals() -> list[Any]:
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    numpy_dtypes = [type(np.dtype(t)) for t in np.sctypeDict.values()]
    return [
        # numpy arrays in the client state (RNG, statistics); numpy 2 pickles them from _core
        importlib.import_module("numpy._core.multiarray")._reconstruct,
        np.ndarray,
        np.dtype,
        *dict.fromkeys(numpy_dtypes),
        LossScaler,  # DeepSpeed's optimizer states (ZeRO 1-3)
        ZeroStageEnum,
        fragment_address,
    ]


SAFE_GLOBALS: list[Any] = []  # filled on first use: importing deepspeed is slow


def safe_load(path: str | Path, map_location: Any = "cpu") -> Any:
    """`torch.load` of ``path`` that unpickles only `SAFE_GLOBALS` beside plain data.

    A file it refuses is a ConfigError naming the file and what it pickles, in one line: a
    permanent failure (``rlfleet serve`` exits EXIT_PERMANENT), since a restart would read the
    same file again."""
    import torch

    from services.errors import ConfigError

    if not SAFE_GLOBALS:
        SAFE_GLOBALS.extend(_safe_globals())
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ConfigError(f"{path}: refusing to load, {_refusal(Path(path), exc)}") from None


def _refusal(path: Path, exc: pickle.UnpicklingError) -> str:
    """Why torch refused ``path``: the classes it pickles beyond `SAFE_GLOBALS`, else the line
    of torch's message that says (its others are advice about ``weights_only``)."""
    import torch

    allowed = {_name(g) for g in SAFE_GLOBALS}
    try:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed
    except Exception:  # not even a readable archive: torch's message is all there is
        unsafe = set()
    if unsafe:
        return f"it pickles {', '.join(sorted(unsafe))}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if "GLOBAL" in line or "Unpickler" in line]
    return f"not loadable with weights_only: {(said or lines or ['no reason given'])[0]}"


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def verify_checkpoint(tag_dir: Path) -> None:
    """Scan every ``.pt`` file of a checkpoint tag without unpickling it and refuse one that
    names a class beyond `SAFE_GLOBALS`; for code that must hand the folder to a loader of
    its own (DeepSpeed's zero_to_fp32 loads with weights_only=False)."""
    import torch

    from services.errors import ConfigError

    if not SAFE_GLOBALS:
        SAFE_GLOBALS.extend(_safe_globals())
    allowed = {_name(g) for g in SAFE_GLOBALS}
    for path in sorted(Path(tag_dir).glob("*.pt")):
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed
        if unsafe:
            raise ConfigError(f"{path}: refusing to load, it pickles {', '.join(sorted(unsafe))}")


def install(engine: Any) -> None:
    """Make a DeepSpeed engine load its checkpoints with `safe_load`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):  # type: ignore[misc]
        def load(self, path: str, map_location: Any = None) -> Any:
            return safe_load(path, map_location)

    current = engine.checkpoint_engine
    if type(current) is TorchCheckpointEngine:
        safe = SafeCheckpointEngine.__new__(SafeCheckpointEngine)
        safe.__dict__.update(current.__dict__)
        engine.checkpoint_engine = safe
