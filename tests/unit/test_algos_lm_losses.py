"""LM policy losses (GSPO, CISPO, SAPO, PPO dual clip): values and gradients against the
written-out formulas, including where the paper's gradient differs from the naive one."""

import math

import pytest
import torch

from learner.algos import POLICY_LOSSES, aggregate, cispo, gspo, ppo_clip, sapo


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=0,
        atol=atol,
    )


def detached_scalars(metrics):
    return all(not m.requires_grad and m.ndim == 0 for m in metrics.values())


def test_registered_under_their_names():
    assert POLICY_LOSSES.get("gspo") is gspo
    assert POLICY_LOSSES.get("cispo") is cispo
    assert POLICY_LOSSES.get("sapo") is sapo


# --- GSPO --------------------------------------------------------------------------------------
# Two sequences, old_logp = -1 everywhere, logp = -1 + per-token log ratio. Row 1 has 2 tokens;
# its third entry is padding with a wild value that must not leak.
LOG_RATIOS = [[0.1, -0.2, 0.4], [0.0, 0.0002, 50.0]]
GSPO_MASK = torch.tensor([[True, True, True], [True, True, False]])
S = [math.exp(0.1), math.exp(0.0001)]  # s_i = exp(mean of valid log ratios)


def gspo_inputs():
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor(LOG_RATIOS, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    return logp, old, adv


def test_gspo_uses_the_sequence_ratio_for_value_and_gradient():
    logp, old, adv = gspo_inputs()
    loss, metrics = gspo(logp, old, adv, GSPO_MASK, clip_low=0.2, clip_high=0.2)
    # every token of sequence i carries -A_i s_i (both ratios inside [0.8, 1.2])
    close(loss[GSPO_MASK], [-S[0]] * 3 + [2 * S[1]] * 2)
    aggregate(loss, GSPO_MASK, "seq-mean-token-mean").backward()
    # paper eq. (11): d/d logp_t = -(1/B) (1/|y_i|) A_i s_i, the same for every token of i
    expected = [[-S[0] / 6] * 3, [2 * S[1] / 4] * 2 + [0.0]]
    close(logp.grad, expected)
    # the naive token-level ratio (GRPO) would give -(1/6) r_t for row 0: different
    naive_row0 = [-math.exp(r) / 6 for r in LOG_RATIOS[0]]
    assert not torch.allclose(logp.grad[0], torch.tensor(naive_row0, dtype=torch.float64))
    close(metrics["ratio_mean"], sum(S) / 2)
    close(metrics["clipfrac"], 0.0)
    valid = [0.1, -0.2, 0.4, 0.0, 0.0002]
    close(metrics["approx_kl"], sum(math.expm1(r) - r for r in valid) / 5)
    close(metrics["token_ratio_mean"], sum(math.exp(r) for r in valid) / 5)
    assert detached_scalars(metrics)


def test_gspo_default_range_clips_whole_sequences():
    logp, old, adv = gspo_inputs()
    loss, metrics = gspo(logp, old, adv, GSPO_MASK)  # paper's (3e-4, 4e-4)
    # row 0: s = e^0.1 > 1 + 4e-4 with A > 0 -> clipped to 1.0004, no gradient for any token
    close(loss[0], [-1.0004] * 3)
    # row 1: s = e^1e-4 inside [0.9997, 1.0004] -> unclipped
    close(loss[1, :2], [2 * S[1]] * 2)
    aggregate(loss, GSPO_MASK, "seq-mean-token-mean").backward()
    close(logp.grad[0], [0.0] * 3)
    close(logp.grad[1, :2], [2 * S[1] / 4] * 2)
    close(metrics["clipfrac"], 3 / 5)


def test_gspo_needs_a_mask():
    logp, old, adv = gspo_inputs()
    with pytest.raises(ValueError, match="mask"):
        gspo(logp, old, adv, None)


# --- CISPO -------------------------------------------------------------------------------------
RATIOS = [1.5, 0.5, 1.1, 0.01]
ADVS = [2.0, -1.0, 1.0, 1.0]


def cispo_inputs():
    old = torch.full((4,), -1.0, dtype=torch.float64)
    logp = (old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).requires_grad_()
    return logp, old, torch.tensor(ADVS, dtype=torch.float64)


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient():
    logp, old, adv = cispo_inputs()
    loss, metrics = cispo(logp, old, adv, clip_low=0.2, clip_high=0.2)
    w = [1.2, 0.8, 1.1, 0.8]  # clip(r, 0.8, 1.2)
    lp = [-1 + math.log(r) for r in RATIOS]
    close(loss, [-wi * a * li for wi, a, li in zip(w, ADVS, lp, strict=True)])
    loss.sum().backward()
    # d/d logp = -w A: no gradient through w, and none is zero
    close(logp.grad, [-2.4, 0.8, -1.1, -0.8])
    # PPO zeroes the clipped ones (r = 1.5 with A > 0, r = 0.5 with A < 0); r = 0.01 with A > 0
    # is below the range but unclipped (pessimistic bound), so PPO's gradient there is -A r
    ppo_logp, _, _ = cispo_inputs()
    ppo_clip(ppo_logp, old, adv, clip_low=0.2)[0].sum().backward()
    close(ppo_logp.grad, [0.0, 0.0, -1.1, -0.01])
    close(metrics["clipfrac"], 3 / 4)
    close(metrics["ratio_mean"], sum(RATIOS) / 4)
    close(metrics["is_weight_mean"], sum(w) / 4)
    close(metrics["approx_kl"], sum((r - 1) - math.log(r) for r in RATIOS) / 4)
    assert detached_scalars(metrics)


def test_cispo_defaults_have_no_lower_bound():
    logp, old, adv = cispo_inputs()
    loss, metrics = cispo(logp, old, adv)  # clip_low None, clip_high 5.0
    loss.sum().backward()
    close(
        logp.grad, [-a * r for a, r in zip(ADVS, RATIOS, strict=True)]
    )  # all r in (0, 6]: unclipped
    close(metrics["clipfrac"], 0.0)
    logp, old, adv = cispo_inputs()
    shifted = logp.detach() + math.log(10.0)  # r = 15, 5, 11, 0.1 -> w = 6, 5, 6, 0.1
    loss, _ = cispo(shifted, old, adv)
    close(
        loss, [-w * a * lp for w, a, lp in zip([6, 5, 6, 0.1], ADVS, shifted.tolist(), strict=True)]
    )


# --- SAPO --------------------------------------------------------------------------------------
def test_sapo_soft_gate_value_and_gradient():
    ratios, advs = [1.0, 2.0, 0.5, 1.3], [1.0, -1.0, 2.0, -0.5]
    old = torch.zeros(4, dtype=torch.float64)
    logp = torch.log(torch.tensor(ratios, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor(advs, dtype=torch.float64)
    loss, metrics = sapo(logp, old, adv, tau_pos=1.0, tau_neg=1.05)
    taus = [1.0 if a > 0 else 1.05 for a in advs]

    def sig(x):
        return 1 / (1 + math.exp(-x))

    gates = [4 / t * sig(t * (r - 1)) for t, r in zip(taus, ratios, strict=True)]
    close(loss, [-g * a for g, a in zip(gates, advs, strict=True)])
    assert loss[0].item() == pytest.approx(-2.0)  # on-policy: (4/1) * 0.5 * 1
    loss.sum().backward()
    # d/d logp = -A f'(r) r with f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1))
    weights = [
        4 * sig(t * (r - 1)) * (1 - sig(t * (r - 1))) for t, r in zip(taus, ratios, strict=True)
    ]
    close(logp.grad, [-a * w * r for a, w, r in zip(advs, weights, ratios, strict=True)])
    assert logp.grad[0].item() == pytest.approx(-1.0)  # on-policy gradient = -A, as PPO's
    close(metrics["gate_weight_mean"], sum(weights) / 4)
    close(metrics["clipfrac"], 1 - sum(weights) / 4)
    close(metrics["ratio_mean"], sum(ratios) / 4)
    assert detached_scalars(metrics)


def test_sapo_rejects_non_positive_temperatures():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="tau"):
        sapo(x, x, x, tau_neg=0.0)


# --- PPO dual clip -----------------------------------------------------------------------------
def test_ppo_dual_clip_caps_negative_advantage_losses():
    ratios, advs = [4.0, 2.0, 4.0], [-1.0, -1.0, 1.0]
    logp = torch.log(torch.tensor(ratios, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor(advs, dtype=torch.float64)
    loss, metrics = ppo_clip(logp, torch.zeros(3, dtype=torch.float64), adv, clip_ratio_c=3.0)
    # r=4, A=-1: max(4, 1.2) = 4, capped at -A c = 3; r=2, A=-1: 2 < 3 stays; A>0 unaffected
    close(loss, [3.0, 2.0, -1.2])
    loss.sum().backward()
    close(logp.grad, [0.0, 2.0, 0.0])
    close(metrics["clipfrac_lower"], 1 / 3)
    assert "clipfrac_lower" not in ppo_clip(logp, logp.detach(), adv)[1]
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip(logp, logp, adv, clip_ratio_c=1.0)
