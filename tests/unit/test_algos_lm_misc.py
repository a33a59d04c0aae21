"""KL estimators, truncated IS, DAPO filters, CHORD, DPO, schedules and the aggregation alias
against hand-computed numbers."""

import math

import pytest
import torch
import torch.nn.functional as F

from learner.algos import (
    KL_ESTIMATORS,
    SCHEDULES,
    UnknownNameError,
    aggregate,
    chord_mix,
    cosine_decay,
    dpo_loss,
    dynamic_sampling_keep,
    kl_penalty,
    overlong_mask,
    sft_loss,
    truncated_is_weights,
    warmup_cosine,
)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=0,
        atol=atol,
    )


# --- KL estimators -----------------------------------------------------------------------------
def test_kl_estimators_per_token():
    p, ref = [0.5, 0.2], [0.25, 0.4]
    logp = torch.log(torch.tensor(p, dtype=torch.float64)).requires_grad_()
    ref_logp = torch.log(torch.tensor(ref, dtype=torch.float64))
    close(kl_penalty(logp, ref_logp, estimator="k1"), [math.log(2), math.log(0.5)])
    close(kl_penalty(logp, ref_logp, estimator="k2"), [0.5 * math.log(2) ** 2] * 2)
    # k3 = ref/p - log(ref/p) - 1
    k3 = [q / pi - math.log(q / pi) - 1 for pi, q in zip(p, ref, strict=True)]
    out = kl_penalty(logp, ref_logp)  # default k3
    close(out, k3)
    out.sum().backward()
    close(
        logp.grad, [1 - q / pi for pi, q in zip(p, ref, strict=True)]
    )  # d k3 / d logp = 1 - ref/p
    close(kl_penalty(logp, ref_logp, estimator="k3", clamp=0.1), [0.1, min(k3[1], 0.1)])
    with pytest.raises(UnknownNameError, match="k4"):
        kl_penalty(logp, ref_logp, estimator="k4")
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_average_to_the_exact_kl(name):
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = (p * (p.log() - ref.log())).sum()
    per_token = kl_penalty(p.log(), ref.log(), estimator=name)  # one "sample" per outcome
    close((p * per_token).sum(), exact)  # expectation under pi_theta


# --- truncated importance sampling -------------------------------------------------------------
def test_truncated_is_weights_and_metrics():
    learner = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)).requires_grad_()
    rollout = torch.log(torch.tensor([[0.25, 0.3, 0.5]], dtype=torch.float64))
    weights, metrics = truncated_is_weights(learner, rollout, None, cap=1.5)
    close(weights, [[1.5, 1.0, 0.4]])  # min(w, 1.5), w = [2, 1, 0.4]
    assert not weights.requires_grad
    k3 = [w - 1 - math.log(w) for w in (2.0, 1.0, 0.4)]
    close(metrics["mismatch_kl"], sum(k3) / 3)
    close(metrics["tis_weight_mean"], 2.9 / 3)
    close(metrics["tis_clipfrac"], 1 / 3)
    weights, metrics = truncated_is_weights(learner, rollout, torch.tensor([[True, True, False]]))
    close(weights, [[2.0, 1.0, 0.0]])  # default cap 2; masked-out -> 0
    close(metrics["mismatch_kl"], sum(k3[:2]) / 2)
    close(metrics["tis_clipfrac"], 0.0)


# --- DAPO filters ------------------------------------------------------------------------------
def test_dynamic_sampling_keeps_groups_with_different_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 0.5, 0.5, 0.5])
    groups = torch.tensor([4, 4, 9, 9, 1, 2, 2, 2])
    keep = dynamic_sampling_keep(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False, False, False]


def test_overlong_mask_drops_truncated_completions():
    mask = torch.tensor([[True, True], [True, False]])
    out = overlong_mask(mask, torch.tensor([True, False]))
    assert out.tolist() == [[False, False], [True, False]]
    with pytest.raises(ValueError):
        overlong_mask(mask, torch.tensor([True]))


# --- CHORD -------------------------------------------------------------------------------------
def test_sft_loss_nll_and_phi_weighting():
    probs = [0.5, 0.9, 0.1]
    logp = torch.log(torch.tensor(probs, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([True, True, False])
    close(sft_loss(logp, mask), [math.log(2), -math.log(0.9), 0.0])
    loss = sft_loss(logp, mask, phi=True)
    close(loss, [0.25 * math.log(2), -0.09 * math.log(0.9), 0.0])  # p (1 - p) * NLL
    loss.sum().backward()
    close(logp.grad, [-0.25, -0.09, 0.0])  # the weight is detached


def test_chord_mix():
    rl, sft = torch.tensor(2.0), torch.tensor(10.0)
    close(chord_mix(rl, sft, 0.25), 0.75 * 2 + 0.25 * 10)
    close(chord_mix(rl, sft, 0.0), 2.0)
    with pytest.raises(ValueError, match="mu"):
        chord_mix(rl, sft, 1.5)


# --- DPO ---------------------------------------------------------------------------------------
def dpo_inputs():
    chosen = torch.tensor([-1.0, -4.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([-3.0, -1.0], dtype=torch.float64)
    ref_c = torch.tensor([-2.0, -3.0], dtype=torch.float64)
    ref_r = torch.tensor([-2.0, -3.0], dtype=torch.float64)
    return chosen, rejected, ref_c, ref_r  # margins h = [2, -3]


def test_dpo_sigmoid_loss_gradient_and_metrics():
    chosen, rejected, ref_c, ref_r = dpo_inputs()
    loss, metrics = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    h = torch.tensor([2.0, -3.0], dtype=torch.float64)
    close(loss, [math.log1p(math.exp(-0.2)), math.log1p(math.exp(0.3))])  # -log sigmoid(b h)
    loss.sum().backward()
    close(chosen.grad, -0.1 * torch.sigmoid(-0.1 * h))
    # rewards beta (logp - ref_logp): chosen [0.1, -0.1], rejected [-0.1, 0.2]
    close(metrics["rewards/chosen"], 0.0)
    close(metrics["rewards/rejected"], 0.05)
    close(metrics["rewards/accuracies"], 0.5)
    close(metrics["rewards/margins"], (0.2 - 0.3) / 2)
    assert all(not m.requires_grad for m in metrics.values())


def test_dpo_variants():
    args = [x.detach() for x in dpo_inputs()]
    h = torch.tensor([2.0, -3.0], dtype=torch.float64)
    loss, _ = dpo_loss(*args, beta=0.1, label_smoothing=0.1)
    close(loss, -0.9 * F.logsigmoid(0.1 * h) - 0.1 * F.logsigmoid(-0.1 * h))
    close(dpo_loss(*args, beta=0.1, loss_type="ipo")[0], [(2 - 5) ** 2, (-3 - 5) ** 2])
    close(dpo_loss(*args, beta=0.1, loss_type="hinge")[0], [0.8, 1.3])
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*args, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, loss_type="ipo", label_smoothing=0.1)


# --- schedules ---------------------------------------------------------------------------------
def test_cosine_and_warmup_cosine():
    assert [cosine_decay(s, 10, 1.0) for s in (0, 5, 10, 20)] == pytest.approx([1, 0.5, 0, 0])
    # CHORD-style: warm up 0 -> 0.9 over 2 steps, cosine 0.9 -> 0.05 over the next 8
    values = [warmup_cosine(s, 10, 0.9, 0.05, warmup=2) for s in (0, 1, 2, 6, 10, 100)]
    assert values == pytest.approx([0.0, 0.45, 0.9, 0.05 + 0.85 * 0.5, 0.05, 0.05])
    assert SCHEDULES.get("cosine") is cosine_decay
    assert SCHEDULES.get("warmup_cosine") is warmup_cosine
    with pytest.raises(ValueError, match="warmup"):
        warmup_cosine(0, 10, 1.0, warmup=11)


# --- aggregation: verl's hyperparameter name ---------------------------------------------------
def test_seq_mean_token_sum_norm_accepts_verls_loss_scale_factor():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # (sum of each sequence / 10), mean over sequences: ((1 + 2) / 10 + 4 / 10) / 2
    expected = 0.35
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10.0), expected)
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", norm=10.0), expected)
    with pytest.raises(ValueError, match="not both"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", norm=1.0, loss_scale_factor=1.0)
