"""Reduce a per-sample loss matrix to the scalar that is back-propagated.

Modes (registered in ``AGGREGATIONS``), for ``loss`` and ``mask`` of shape ``[B, T]`` (B sequences,
T steps/tokens; ``m`` the 0/1 mask, ``n_b = sum_t m[b, t]``, ``S`` the sequences with ``n_b > 0``):

- ``token-mean``: ``sum_{b,t} m l / sum_{b,t} m``: every token weighs the same (DAPO;
  for game RL with ``[B]`` losses this is the plain minibatch mean);
- ``seq-mean-token-mean``: ``1/|S| sum_{b in S} (sum_t m l / n_b)``: every sequence weighs the same
  (the GRPO paper, Shao et al. 2024);
- ``seq-mean-token-sum-norm``: ``1/|S| sum_{b in S} (sum_t m l) / norm`` with a constant ``norm``
  (default T): no length normalisation (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, which divides
  by the generation budget MAX_TOKENS). Current verl (``agg_loss``) computes the same: per-sequence
  token sums divided by ``loss_scale_factor`` (default: the padded response length T), then the
  sequence mean; ``loss_scale_factor`` is accepted here as another name for ``norm``. Set it to
  the generation limit so the divisor does not change with the padding of each batch. Older verl
  releases left out the 1/|S| (a constant factor |S|), and verl counts padding rows in |S|.

Fully masked sequences (padding rows) are excluded from |S| so they do not dilute the mean; an
all-masked batch gives 0 (still attached to the graph). Masked-out entries are dropped with
``torch.where``, so NaN/inf there does not leak.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algos.registry import AGGREGATIONS


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is true (all when None); empty mask -> 0."""
    if mask is None:
        return x.mean()
    mask = mask.bool().expand_as(x)
    return _masked_sum(x, mask) / mask.sum().clamp(min=1)


def _masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    kept = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


@AGGREGATIONS.register("token-mean")
def token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(loss, mask)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    n_tokens = mask.sum(dim=-1)  # [B]
    per_seq = _masked_sum(loss, mask, dim=-1) / n_tokens.clamp(min=1)  # [B]
    return masked_mean(per_seq, n_tokens > 0)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, norm: float | None = None, loss_scale_factor: float | None = None
) -> Tensor:
    if norm is not None and loss_scale_factor is not None:
        raise ValueError("give norm or loss_scale_factor (verl's name for it), not both")
    norm = loss_scale_factor if norm is None else norm
    norm = float(mask.shape[-1]) if norm is None else norm
    per_seq = _masked_sum(loss, mask, dim=-1) / norm  # [B]
    return masked_mean(per_seq, mask.sum(dim=-1) > 0)


def aggregate(
    loss: Tensor,  # [B, T], or [B] / [B, 1] for one-step samples (game RL)
    mask: Tensor | None = None,  # same shape, bool; None = every entry counts
    mode: str = "token-mean",
    **kwargs: float,
) -> Tensor:
    """Reduce ``loss`` to a 0-dim tensor with the aggregation ``mode`` (see the module docstring).

    ``kwargs`` go to the mode (``norm=`` or ``loss_scale_factor=`` for ``seq-mean-token-sum-norm``).
    """
    fn = AGGREGATIONS.get(mode)
    if loss.ndim == 1:
        loss = loss.unsqueeze(-1)  # [B, 1]
        mask = None if mask is None else mask.reshape(loss.shape)
    if loss.ndim != 2:
        raise ValueError(f"loss must be [B, T], [B, 1] or [B], got shape {tuple(loss.shape)}")
    mask = torch.ones_like(loss, dtype=torch.bool) if mask is None else mask.bool()
    if mask.shape != loss.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must match loss {tuple(loss.shape)}")
    return fn(loss, mask, **kwargs)
