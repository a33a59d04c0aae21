"""One GRPO-family update, in two parts like the game side's ``prepare``/``update``
(learner.game):

1. ``prepare``: once per update, without gradients: the collated batch, its loss masks, the old
   (pi_old: the sampler's log-probs for stale rows, recomputed for the others, as the preset's
   ``old_logp`` says) and reference log-probs, truncated-IS weights and the advantages;
2. ``minibatch_loss``: the loss of one minibatch: the policy loss the preset names, plus KL,
   entropy and CHORD's SFT term;

and ``lm_update`` runs them: epochs x shuffled minibatches of ``minibatch_loss`` on the engine,
one optimizer step per minibatch. With ``micro_batch_size`` a minibatch runs forward and
backward in micro-batches of that many sequences whose gradients accumulate into its one step
(see ``minibatch_loss``: each micro-batch's aggregates are weighted by its share of the
minibatch's normaliser, so the sum is the minibatch's loss and its gradient), and the no-grad
passes of ``prepare`` chunk by it too: peak activation memory follows ``micro_batch_size``, not
the minibatch.
Every algorithmic piece is a registered pure function from ``learner.algos`` chosen by the
``Preset``. Metrics are CleanRL-named: ``losses/policy_loss`` is the policy-gradient term alone
(as on the game side), ``losses/loss`` the total that is minimised.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from learner.algos import (
    GROUP_ADVANTAGES,
    POLICY_LOSSES,
    aggregate,
    dynamic_sampling_keep,
    kl_penalty,
    masked_mean,
    overlong_mask,
    sft_loss,
    truncated_is_weights,
)
from learner.algos.losses import chord_mix
from learner.algos.presets import Preset
from learner.engine import check_step
from learner.lm.batch import Batch, Sample, collate
from learner.lm.model import batch_logprobs

if TYPE_CHECKING:
    from learner.engine import TrainEngine

__all__ = ["Prepared", "group_filter", "lm_update", "minibatch_loss", "prepare"]


def group_filter(samples: Sequence[Sample], preset: Preset) -> tuple[list[Sample], str | None]:
    """The samples of one group worth training on, and why the group was dropped (or None).

    Completions no reward function scored are left out; with DAPO's dynamic sampling a group
    whose rewards are all equal carries no signal (every advantage is 0) and is dropped whole.
    """
    scored = [s for s in samples if s.reward is not None or s.expert]
    rl = [s for s in scored if not s.expert]
    if not rl:
        return [], "unscored"
    if preset.dynamic_sampling and len({s.reward for s in rl}) < 2:
        return [], "uniform"
    return scored, None


def _forward_logp(
    model: TrainEngine | nn.Module,
    batch: Batch,
    rows: Tensor | None,
    entropy_grad: bool,
    pack_tokens: int | None,
) -> tuple[Tensor, Tensor]:
    b = batch if rows is None else batch.select(rows)
    logp, entropy = batch_logprobs(model, b, entropy_grad=entropy_grad, pack_tokens=pack_tokens)
    assert entropy is not None
    return logp, entropy


@torch.no_grad()
def _no_grad_logp(
    model: TrainEngine | nn.Module, batch: Batch, chunk: int, pack_tokens: int | None
) -> Tensor:
    parts = []
    for start in range(0, len(batch), chunk):
        b = batch.select(torch.arange(start, min(start + chunk, len(batch))))
        logp, _ = batch_logprobs(model, b, entropy=False, pack_tokens=pack_tokens)
        parts.append(logp)
    return torch.cat(parts)  # [B, L-1]


# What each aggregation (learner.algos.aggregation) divides by, from its [b, T] mask: tokens, or
# sequences with at least one token. Every one is linear in the loss, so the aggregate of a whole
# minibatch is the sum over its micro-batches of their aggregates, each weighted by its share of
# this normaliser (``seq-mean-token-sum-norm``'s default norm, T, is the same in every part:
# ``Batch.select`` keeps the padded length).
_NORMALISERS: dict[str, Callable[[Tensor], Tensor]] = {
    "token-mean": lambda mask: mask.sum(),
    "seq-mean-token-mean": lambda mask: (mask.sum(-1) > 0).sum(),
    "seq-mean-token-sum-norm": lambda mask: (mask.sum(-1) > 0).sum(),
}


def _share(mode: str, part: Tensor, whole: Tensor | None) -> float:
    """The weight of a micro-batch's ``mode`` aggregate over mask ``part`` ``[b, T]`` in that of
    its minibatch (mask ``whole``): its share of the normaliser (1 when ``whole`` is None)."""
    if whole is None:
        return 1.0
    if mode not in _NORMALISERS:
        raise ValueError(
            f"micro_batch_size: aggregation {mode!r} has no known normaliser to split a minibatch "
            f"by (known: {', '.join(sorted(_NORMALISERS))}); unset micro_batch_size"
        )
    count = _NORMALISERS[mode]
    return float(count(part)) / max(float(count(whole)), 1.0)


@dataclass
class Prepared:
    """What every minibatch of one update reads: tensors ``[B, L-1]`` unless noted."""

    batch: Batch
    mask: Tensor  # bool: the RL tokens that count in the policy loss
    expert_mask: Tensor  # bool: CHORD's SFT tokens (expert completions)
    old_logp: Tensor  # pi_old: per row the sampler's or recomputed (preset.old_logp)
    tis: Tensor  # truncated importance-sampling weights (1 without a cap)
    ref_logp: Tensor | None  # the reference model's, when the preset has a KL term
    adv: Tensor  # advantages (0 on expert rows)
    metrics: dict[str, Any]  # rollout/* and adv/* statistics of the batch
    pack_tokens: int | None = None  # forward passes packed into rows of this many tokens


def _stale_rows(samples: Sequence[Sample], version: int | None) -> Tensor:
    """``[B]`` bool: sampled by a policy older than the learner's ``version`` (None: none)."""
    if version is None:
        return torch.zeros(len(samples), dtype=torch.bool)
    return torch.tensor([s.policy_version < version for s in samples], dtype=torch.bool)


@torch.no_grad()
def _old_logp(
    engine: TrainEngine,
    batch: Batch,
    mask: Tensor,
    stale: Tensor,
    preset: Preset,
    chunk: int,
    pack_tokens: int | None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """pi_old ``[B, L-1]`` as ``preset.old_logp`` chooses it per row (see
    ``learner.algos.presets.OldLogp``), the truncated-IS weights ``[B, L-1]`` and metrics.

    Only the rows whose pi_old is recomputed get a forward pass; the sampler/learner mismatch
    (``rollout/mismatch_kl``, ``tis_*``) is measured on them: on fresh rows it is the numeric
    mismatch alone, on stale ones (``recompute``) it also holds the policy's move since.
    """
    rl = ~batch.expert  # [B]
    if preset.old_logp == "behaviour":
        recompute = torch.zeros_like(rl)
    elif preset.old_logp == "recompute":
        recompute = rl
    else:  # auto
        recompute = rl & ~stale
    old_logp = batch.rollout_logp.clone()  # [B, L-1]
    tis = torch.ones_like(old_logp)  # [B, L-1]
    metrics: dict[str, Any] = {}
    if bool(rl.any()):
        metrics["rollout/stale_frac"] = stale[rl].float().mean()
        metrics["rollout/behaviour_frac"] = (~recompute[rl]).float().mean()
    rows = recompute.nonzero().squeeze(-1)  # [R]
    if len(rows):
        sub = batch.select(rows)
        recomputed = _no_grad_logp(engine, sub, chunk, pack_tokens)  # [R, L-1]
        old_logp[rows] = recomputed
        weights, tis_metrics = truncated_is_weights(
            recomputed, sub.rollout_logp, mask[rows], cap=preset.tis_cap or float("inf")
        )
        metrics.update({f"rollout/{k}": v for k, v in tis_metrics.items()})
        if preset.tis_cap is not None:
            tis[rows] = weights
    return old_logp, tis, metrics


@torch.no_grad()
def prepare(
    engine: TrainEngine,
    reference: nn.Module | None,
    samples: Sequence[Sample],
    preset: Preset,
    *,
    pad_id: int,
    minibatch_size: int = 32,
    micro_batch_size: int | None = None,
    version: int | None = None,
    pack_tokens: int | None = None,
) -> Prepared:
    """Collate ``samples`` (whole groups) and compute, once, everything the minibatches need.

    ``version`` is the learner's current policy version: samples of an older one are stale
    (see ``preset.old_logp``); None treats every sample as sampled by the current weights.
    The forward passes run ``micro_batch_size`` sequences at a time (None: ``minibatch_size``),
    packed into rows of ``pack_tokens`` tokens when set (learner/lm/packing.py).
    """
    chunk = micro_batch_size or minibatch_size
    batch = collate(samples, pad_id)
    rl_rows = (~batch.expert).nonzero().squeeze(-1)  # [R]
    mask = batch.mask & ~batch.expert[:, None]  # [B, L-1] RL tokens
    if preset.overlong_filter:
        mask = overlong_mask(mask, batch.truncated)
    expert_mask = batch.mask & batch.expert[:, None]  # [B, L-1] CHORD's SFT tokens

    stale = _stale_rows(samples, version)  # [B]
    old_logp, tis, metrics = _old_logp(engine, batch, mask, stale, preset, chunk, pack_tokens)
    ref_logp = None
    if preset.kl_beta > 0:
        assert reference is not None, "kl_beta > 0 needs a reference model"
        ref_logp = _no_grad_logp(reference, batch, chunk, pack_tokens)

    # Advantages over the RL rows (group statistics never see expert completions).
    token_rewards = None
    if ref_logp is not None and preset.kl_in_reward:
        token_rewards = -preset.kl_beta * kl_penalty(
            old_logp, ref_logp, estimator=preset.kl_estimator
        )
    adv = torch.zeros_like(old_logp)  # [B, L-1]
    if len(rl_rows):
        kwargs = dict(preset.advantage_kwargs)
        if token_rewards is not None:
            kwargs["token_rewards"] = token_rewards[rl_rows]
        rl_adv, adv_metrics = GROUP_ADVANTAGES.get(preset.advantage)(
            batch.rewards[rl_rows], batch.group_ids[rl_rows], mask[rl_rows], **kwargs
        )
        adv[rl_rows] = rl_adv.to(adv.dtype)
        metrics.update({f"adv/{k}": v for k, v in adv_metrics.items()})
    if preset.dynamic_sampling and len(rl_rows):
        keep = dynamic_sampling_keep(batch.rewards[rl_rows], batch.group_ids[rl_rows])
        metrics["rollout/kept_frac"] = keep.float().mean()
    return Prepared(batch, mask, expert_mask, old_logp, tis, ref_logp, adv, metrics, pack_tokens)


def minibatch_loss(
    engine: TrainEngine,
    prep: Prepared,
    rows: Tensor,
    preset: Preset,
    step: int,
    *,
    minibatch: Tensor | None = None,
) -> tuple[Tensor, dict[str, float], dict[str, float]]:
    """The loss to minimise on ``rows`` of the prepared batch, its metrics, and CHORD's (empty
    when the minibatch has no expert rows, so they are averaged over the ones that had).

    ``minibatch``: the rows of the minibatch ``rows`` is a micro-batch of (None: ``rows`` is the
    minibatch). Then each aggregate is weighted by the micro-batch's share of the minibatch's
    normaliser, so the micro-batches' losses (and gradients) sum to the minibatch's; the metrics
    then describe the micro-batch alone, its loss terms weighted so (``lm_update`` reports the
    minibatch's own)."""
    entropy_grad = preset.entropy_coef != 0
    logp, entropy = _forward_logp(engine, prep.batch, rows, entropy_grad, prep.pack_tokens)
    return _objective(prep, rows, logp, entropy, preset, step, minibatch)


def _objective(
    prep: Prepared,
    rows: Tensor,
    logp: Tensor,  # [b, L-1] the policy's log-probs of ``rows``
    entropy: Tensor,  # [b, L-1]
    preset: Preset,
    step: int,
    minibatch: Tensor | None,
) -> tuple[Tensor, dict[str, float], dict[str, float]]:
    """``minibatch_loss`` from the policy's log-probs and entropy of ``rows``."""
    m, em = prep.mask[rows], prep.expert_mask[rows]
    whole_m = None if minibatch is None else prep.mask[minibatch]
    whole_em = em if minibatch is None else prep.expert_mask[minibatch]
    share = _share(preset.aggregation, m, whole_m)
    loss_tok, loss_metrics = POLICY_LOSSES.get(preset.policy_loss)(
        logp, prep.old_logp[rows], prep.adv[rows], m, **preset.loss_kwargs
    )
    pg_loss = share * aggregate(
        loss_tok * prep.tis[rows], m, preset.aggregation, **preset.aggregation_kwargs
    )
    loss = pg_loss
    metrics = {"losses/policy_loss": float(pg_loss.detach())}
    if prep.ref_logp is not None and not preset.kl_in_reward:
        kl = kl_penalty(logp, prep.ref_logp[rows], estimator=preset.kl_estimator)  # [b, L-1]
        kl_loss = share * aggregate(kl, m, preset.aggregation, **preset.aggregation_kwargs)
        loss = loss + preset.kl_beta * kl_loss
        metrics["losses/kl"] = float(kl_loss.detach())
    if preset.entropy_coef != 0:
        entropy_term = aggregate(entropy, m, "token-mean") * _share("token-mean", m, whole_m)
        loss = loss - preset.entropy_coef * entropy_term
    chord: dict[str, float] = {}
    if preset.chord and bool(whole_em.any()):  # the minibatch's expert rows decide
        sft = aggregate(sft_loss(logp, em, phi=preset.chord_phi), em, "token-mean")
        sft = sft * _share("token-mean", em, None if minibatch is None else whole_em)
        mu = preset.chord_mu(step)
        loss = chord_mix(loss, sft, mu)
        chord = {"losses/sft": float(sft.detach()), "charts/chord_mu": mu}
    metrics["losses/loss"] = float(loss.detach())
    metrics["charts/entropy"] = float(masked_mean(entropy.detach(), m))
    metrics.update({f"losses/{key}": float(value) for key, value in loss_metrics.items()})
    return loss, metrics, chord


def _train_minibatch(
    engine: TrainEngine,
    prep: Prepared,
    rows: Tensor,
    preset: Preset,
    step: int,
    micro_batch_size: int | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """One optimizer step on the minibatch ``rows``, forward and backward ``micro_batch_size``
    rows at a time (None: all at once); returns the minibatch's metrics and CHORD's."""
    if micro_batch_size is None or micro_batch_size >= len(rows):
        loss, metrics, chord = minibatch_loss(engine, prep, rows, preset, step)
        engine.backward(loss)
        check_step(engine, loss)  # never a NaN/inf step (NonfiniteUpdate)
        engine.step()
        return metrics, chord
    entropy_grad = preset.entropy_coef != 0
    parts = rows.split(micro_batch_size)
    logps, entropies, losses = [], [], []
    try:
        for i, part in enumerate(parts):
            logp, entropy = _forward_logp(engine, prep.batch, part, entropy_grad, prep.pack_tokens)
            loss, _, _ = _objective(prep, part, logp, entropy, preset, step, rows)
            engine.accumulation_boundary(last=i == len(parts) - 1)
            engine.backward(loss)
            losses.append(loss.detach())
            logps.append(logp.detach())
            entropies.append(entropy.detach())
    finally:  # every later backward ends its step again (SFT, a failed update's retry)
        engine.accumulation_boundary(last=True)
    check_step(engine, torch.stack(losses).sum())  # any micro-batch's NaN/inf stops the step
    engine.step()
    # The metrics of the whole minibatch, as without micro-batches: from the same log-probs
    # (element-wise work on [b, L-1] tensors, no forward pass).
    with torch.no_grad():
        _, metrics, chord = _objective(
            prep, rows, torch.cat(logps), torch.cat(entropies), preset, step, None
        )
    return metrics, chord


def lm_update(
    engine: TrainEngine,
    reference: nn.Module | None,
    samples: Sequence[Sample],
    preset: Preset,
    *,
    pad_id: int,
    lr: float,
    step: int,
    epochs: int = 1,
    minibatch_size: int = 32,
    micro_batch_size: int | None = None,
    version: int | None = None,
    generator: torch.Generator | None = None,
    pack_tokens: int | None = None,
) -> dict[str, float]:
    """Train on ``samples`` (whole groups) at the learner's policy ``version`` (see
    ``prepare``); returns scalar metrics (CleanRL-style names), each the mean over the
    minibatches that had it.

    ``micro_batch_size``: sequences per forward/backward pass (None: the minibatch); the
    gradients of a minibatch's micro-batches accumulate into its one optimizer step, with the
    same loss (and metrics) as the minibatch at once. ``pack_tokens``: forward passes packed
    into rows of that many tokens (None: padded rows), the same values on less padding."""
    if micro_batch_size is not None and not 1 <= micro_batch_size <= minibatch_size:
        raise ValueError(
            f"micro_batch_size ({micro_batch_size}) must lie in [1, minibatch_size "
            f"({minibatch_size})]"
        )
    engine.set_lr(lr)
    prep = prepare(
        engine,
        reference,
        samples,
        preset,
        pad_id=pad_id,
        minibatch_size=minibatch_size,
        micro_batch_size=micro_batch_size,
        version=version,
        pack_tokens=pack_tokens,
    )
    sums: dict[str, float] = collections.defaultdict(float)
    chord_sums: dict[str, float] = collections.defaultdict(float)
    steps = chord_steps = 0
    for _ in range(epochs):
        order = torch.randperm(len(prep.batch), generator=generator)
        for start in range(0, len(prep.batch), minibatch_size):
            rows = order[start : start + minibatch_size]
            metrics, chord = _train_minibatch(engine, prep, rows, preset, step, micro_batch_size)
            steps += 1
            for key, value in metrics.items():
                sums[key] += value
            if chord:
                chord_steps += 1
                for key, value in chord.items():
                    chord_sums[key] += value
    out = {k: v / max(steps, 1) for k, v in sums.items()}
    out.update({k: v / chord_steps for k, v in chord_sums.items()})
    out.update({k: float(v) for k, v in prep.metrics.items()})
    rl = [s for s in samples if not s.expert]
    out["charts/learning_rate"] = lr
    out["rollout/completion_tokens"] = float(sum(len(s.completion_ids) for s in rl))
    out["rollout/completion_len"] = out["rollout/completion_tokens"] / max(len(rl), 1)
    return out
