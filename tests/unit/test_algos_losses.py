"""Policy/value/entropy losses, normalisation, aggregation and schedules against hand-computed
numbers."""

import math

import pytest
import torch

from learner.algos import (
    AGGREGATIONS,
    POLICY_LOSSES,
    SCHEDULES,
    UnknownNameError,
    a2c,
    aggregate,
    entropy_from_logits,
    entropy_loss,
    linear_anneal,
    normalize_advantages,
    ppo_clip,
    value_loss,
)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=0,
        atol=atol,
    )


# --- PPO clipped surrogate -------------------------------------------------------------------
# old_logp = 0 and logp = log(ratio), so ratio is what we write. clip 0.2 -> range [0.8, 1.2].
RATIOS = [1.5, 0.5, 1.5, 0.5, 1.1]
ADVS = [2.0, 2.0, -1.0, -1.0, 1.0]


def ppo_inputs():
    logp = torch.log(torch.tensor(RATIOS, dtype=torch.float64)).requires_grad_()
    return logp, torch.zeros(5, dtype=torch.float64), torch.tensor(ADVS, dtype=torch.float64)


def test_ppo_clip_both_sides_and_both_signs():
    logp, old_logp, adv = ppo_inputs()
    loss, metrics = ppo_clip(logp, old_logp, adv, clip_low=0.2)
    # loss = max(-A r, -A clip(r, 0.8, 1.2))
    # r=1.5, A=+2: max(-3.0, -2.4) = -2.4  clipped: no reward for pushing r further up
    # r=0.5, A=+2: max(-1.0, -1.6) = -1.0  unclipped: free to raise r back
    # r=1.5, A=-1: max( 1.5,  1.2) =  1.5  unclipped: pessimistic bound keeps the penalty
    # r=0.5, A=-1: max( 0.5,  0.8) =  0.8  clipped
    # r=1.1, A=+1: inside the range:  -1.1
    close(loss, [-2.4, -1.0, 1.5, 0.8, -1.1])
    # d loss / d logp = -A r where the unclipped term is active, 0 where clipped
    loss.sum().backward()
    close(logp.grad, [0.0, -1.0, 1.5, 0.0, -1.1])
    # ratio outside [0.8, 1.2]: 4 of 5. k3 KL: mean((r - 1) - log r)
    close(metrics["clipfrac"], 0.8)
    close(metrics["ratio_mean"], (1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)
    k3 = [(r - 1) - math.log(r) for r in RATIOS]
    close(metrics["approx_kl"], sum(k3) / 5)
    assert all(not m.requires_grad and m.ndim == 0 for m in metrics.values())


def test_ppo_clip_asymmetric_high():
    logp, old_logp, adv = ppo_inputs()
    loss, metrics = ppo_clip(logp, old_logp, adv, clip_low=0.2, clip_high=0.6)
    # range [0.8, 1.6]: r=1.5 is now inside. r=1.5, A=+2: -3.0; r=1.5, A=-1: 1.5
    close(loss, [-3.0, -1.0, 1.5, 0.8, -1.1])
    close(metrics["clipfrac"], 0.4)


def test_ppo_clip_mask_changes_metrics_only():
    logp, old_logp, adv = ppo_inputs()
    mask = torch.tensor([False, False, False, False, True])
    loss, metrics = ppo_clip(logp, old_logp, adv, mask)
    close(loss, [-2.4, -1.0, 1.5, 0.8, -1.1])
    close(metrics["clipfrac"], 0.0)
    close(metrics["ratio_mean"], 1.1)
    close(metrics["approx_kl"], 0.1 - math.log(1.1))


def test_ppo_clip_is_identity_surrogate_on_policy():
    # ratio = 1: loss = -A, gradient -A, kl 0
    logp = torch.tensor([[-0.3, -1.2]], requires_grad=True)  # [B=1, T=2]
    adv = torch.tensor([[0.5, -2.0]])
    loss, metrics = ppo_clip(logp, logp.detach(), adv)
    close(loss, [[-0.5, 2.0]])
    loss.sum().backward()
    close(logp.grad, [[-0.5, 2.0]])
    close(metrics["approx_kl"], 0.0)


# --- A2C -----------------------------------------------------------------------------------------
def test_a2c():
    logp = torch.log(torch.tensor([0.5, 0.25])).requires_grad_()
    adv = torch.tensor([2.0, -1.0], requires_grad=True)
    loss, metrics = a2c(logp, torch.log(torch.tensor([0.5, 0.5])), adv)
    # -A log p: -2 ln 0.5 = 2 ln 2; +1 ln 0.25 = -2 ln 2
    close(loss, [2 * math.log(2), -2 * math.log(2)])
    loss.sum().backward()
    close(logp.grad, [-2.0, 1.0])
    assert adv.grad is None  # advantages are constants
    close(metrics["logp_mean"], (math.log(0.5) + math.log(0.25)) / 2)
    # k3 with r = [1, 0.5]: (0.5 - 1) - ln 0.5 = ln 2 - 0.5, mean over 2
    close(metrics["approx_kl"], (math.log(2) - 0.5) / 2)
    assert POLICY_LOSSES.get("a2c") is a2c
    loss, metrics = a2c(logp, None, adv)  # old_logp is optional: no approx_kl then
    assert "approx_kl" not in metrics


# --- value loss ----------------------------------------------------------------------------------
def test_value_loss_unclipped():
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss, metrics = value_loss(values, None, torch.tensor([2.0, 2.0, 0.0]))
    close(loss, [0.5, 0.0, 4.5])  # 0.5 * (V - R)^2
    close(metrics["value_mean"], 2.0)
    assert "vf_clipfrac" not in metrics


def test_value_loss_clipped():
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    old = torch.tensor([1.5, 1.5, 1.5])
    returns = torch.tensor([2.0, 2.0, 0.0])
    loss, metrics = value_loss(values, old, returns, clip=0.2)
    # V_clip = old + clip(V - old, -0.2, 0.2) = [1.3, 1.7, 1.7]
    # V=1: max((1-2)^2, (1.3-2)^2) = max(1, 0.49) = 1    -> 0.5
    # V=2: max((2-2)^2, (1.7-2)^2) = max(0, 0.09) = 0.09 -> 0.045 (clipped term wins)
    # V=3: max((3-0)^2, (1.7-0)^2) = max(9, 2.89) = 9   -> 4.5
    close(loss, [0.5, 0.045, 4.5])
    close(metrics["vf_clipfrac"], 1 / 3)
    loss.sum().backward()
    close(values.grad, [-1.0, 0.0, 3.0])  # V - R where unclipped wins, 0 where clipped wins
    with pytest.raises(ValueError, match="old_values"):
        value_loss(values, None, returns, clip=0.2)


# --- entropy -------------------------------------------------------------------------------------
def test_entropy():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]])
    h = entropy_from_logits(logits[:1])
    close(h, [math.log(4)])  # uniform over 4
    # p = [1/4, 3/4]: H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    h2 = entropy_from_logits(torch.tensor([[0.0, math.log(3.0)]]))
    close(h2, [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    loss, metrics = entropy_loss(torch.tensor([1.0, 3.0]), torch.tensor([True, False]))
    close(loss, [-1.0, -3.0])
    close(metrics["entropy"], 1.0)


# --- advantage normalisation ---------------------------------------------------------------------
def test_normalize_advantages():
    # mean 2.5; unbiased var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3; std = 1.2909944
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0])
    std = math.sqrt(5 / 3)
    close(normalize_advantages(adv), [-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std], atol=1e-5)
    close(normalize_advantages(adv, shift_mean=False), [1 / std, 2 / std, 3 / std, 4 / std], 1e-5)


def test_normalize_advantages_masked():
    # kept [1, 3]: mean 2, unbiased var (1 + 1) / 1 = 2, std sqrt 2; masked entries -> 0
    adv = torch.tensor([1.0, 100.0, 3.0, math.nan])
    mask = torch.tensor([True, False, True, False])
    s = math.sqrt(2)
    close(normalize_advantages(adv, mask), [-1 / s, 0.0, 1 / s, 0.0], atol=1e-6)
    close(normalize_advantages(torch.tensor([5.0])), [0.0])  # one sample: no NaN


# --- aggregation ---------------------------------------------------------------------------------
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [B=2, T=3]
MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_aggregate_token_mean():
    close(aggregate(LOSS, MASK, "token-mean"), (1 + 2 + 4) / 3)


def test_aggregate_seq_mean_token_mean():
    close(aggregate(LOSS, MASK, "seq-mean-token-mean"), ((1 + 2) / 2 + 4 / 1) / 2)


def test_aggregate_seq_mean_token_sum_norm():
    # (sum_t per sequence) / T, mean over sequences: ((1 + 2) / 3 + 4 / 3) / 2 = 7/6
    close(aggregate(LOSS, MASK, "seq-mean-token-sum-norm"), 7 / 6)
    close(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm=10.0), (0.3 + 0.4) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_ignores_padding_rows_and_masked_nan(mode):
    loss = torch.cat([LOSS, torch.tensor([[7.0, 8.0, 9.0]])])  # a fully masked padding row
    loss[0, 2] = math.nan
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    close(aggregate(loss, mask, mode), aggregate(LOSS, MASK, mode))


def test_aggregate_game_rl_shapes_and_gradient():
    loss = torch.tensor([1.0, 2.0, 6.0], requires_grad=True)  # [B]
    out = aggregate(loss)
    close(out, 3.0)
    out.backward()
    close(loss.grad, [1 / 3] * 3)
    close(aggregate(loss.detach().reshape(3, 1), mode="seq-mean-token-mean"), 3.0)  # [B, 1]
    close(aggregate(loss.detach(), torch.tensor([True, False, True])), 3.5)


def test_aggregate_unknown_mode_and_registry():
    with pytest.raises(UnknownNameError, match=r"known: .*token-mean.*did you mean 'token-mean'"):
        aggregate(LOSS, MASK, "token-median")
    assert AGGREGATIONS.get("token-mean")(LOSS, MASK) == aggregate(LOSS, MASK)


# --- schedules -----------------------------------------------------------------------------------
def test_linear_anneal():
    assert linear_anneal(0, 10, 1.0) == 1.0
    assert linear_anneal(5, 10, 1.0) == 0.5
    assert linear_anneal(10, 10, 1.0) == 0.0
    assert linear_anneal(20, 10, 1.0) == 0.0  # held at the end value
    close(linear_anneal(5, 10, 1.0, end=0.1), 0.55)
    # CleanRL anneal_lr over 4 iterations: lr * (1 - (i - 1) / 4) for i = 1..4
    lrs = [linear_anneal(i - 1, 4, 2.5e-4) for i in range(1, 5)]
    close(lrs, [2.5e-4, 1.875e-4, 1.25e-4, 0.625e-4], atol=1e-12)
    assert SCHEDULES.get("constant")(7, 10, 3e-4) == 3e-4
    assert SCHEDULES.get("linear") is linear_anneal
    with pytest.raises(ValueError):
        linear_anneal(0, 0, 1.0)


def test_normalize_advantages_of_equal_entries_is_exactly_zero():
    # 0.1 is not a float: a mean taken from the sum is an ulp off, and dividing that noise by
    # its own std gave entries of about +-0.4 instead of 0
    for shape in [(8,), (3, 7), (16, 5)]:
        adv = torch.full(shape, 0.1)
        assert torch.equal(normalize_advantages(adv), torch.zeros(shape))
    adv = torch.tensor([0.7, 0.7, 9.0, 0.7])
    mask = torch.tensor([True, True, False, True])
    assert torch.equal(normalize_advantages(adv, mask), torch.zeros(4))
