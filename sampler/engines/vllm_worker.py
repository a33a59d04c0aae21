"""Runs inside vLLM's worker processes (named by `worker_extension_cls`): new weights in place.

In vLLM's default multi-process mode, tensors passed through `collective_rpc` do not arrive as
tensors (docs/platform.md), so the engine sends each tensor as (name, dtype name, shape, raw bytes)
and this method rebuilds them. It calls `reload_weights`, not `model.load_weights`: on CPU the
latter leaves the repacked linear weights empty. Kept free of other rlfleet imports: every
worker process imports it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RlfleetWeightReceiver"]


class RlfleetWeightReceiver:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def rlfleet_reload_weights(self, items: list[tuple[str, str, list[int], bytes]]) -> int:
        """Load Hugging Face-named tensors; returns how many were passed to the model."""
        tensors = []
        for name, dtype, shape, data in items:
            # bytearray: torch.frombuffer needs a writable buffer to avoid a warning per tensor.
            flat = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype))
            tensors.append((name, flat.reshape(shape)))
        worker: Any = self
        worker.reload_weights(weights_iterator=iter(tensors))
        return len(tensors)
