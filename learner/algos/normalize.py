"""Advantage normalisation (whitening) over a batch, optionally masked."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.aggregation import masked_mean


def normalize_advantages(
    adv: Tensor,  # [B] or [B, T]
    mask: Tensor | None = None,  # same shape, bool; None = every entry counts
    *,
    eps: float = 1e-8,
    shift_mean: bool = True,
) -> Tensor:
    """``(adv - mean) / (std + eps)`` over the entries where ``mask`` is true, as CleanRL's
    ``norm_adv`` (std with Bessel's correction, n - 1). ``shift_mean=False`` only rescales.

    Masked-out entries come back as 0. With fewer than two entries the std is taken as 0 (the
    centred advantages are then 0 as well); entries that are all equal centre to exactly 0.
    Computed without gradient.
    """
    with torch.no_grad():
        keep = torch.ones_like(adv, dtype=torch.bool) if mask is None else mask.bool()
        keep = keep.expand_as(adv)
        zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
        n = keep.sum()
        # Offsets to the smallest kept entry are exactly 0 when every kept entry is equal, so such
        # a batch whitens to exactly 0 rather than to rounding noise divided by its own std.
        low = torch.where(keep, adv, torch.inf).amin() if adv.numel() else zero  # []
        offset = torch.where(keep, adv - low, zero)
        centred = torch.where(keep, offset - masked_mean(offset, keep), zero)
        var = (centred**2).sum() / (n - 1).clamp(min=1)
        scaled = (centred if shift_mean else torch.where(keep, adv, zero)) / (var.sqrt() + eps)
        return scaled
