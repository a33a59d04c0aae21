"""LM advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) against hand-computed numbers."""

import math

import pytest
import torch

from learner.algos import (
    GAME_ADVANTAGES,
    GROUP_ADVANTAGES,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    token_returns,
)
from learner.algos.advantages.groups import group_stats


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=0,
        atol=atol,
    )


# Three groups: id 7 -> rewards [1, 0, 0]; id 3 -> [2, 2] (all equal); id 9 -> [5] (alone).
REWARDS = torch.tensor([1.0, 2.0, 0.0, 5.0, 2.0, 0.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 3, 7, 9, 3, 7])
LENGTHS = [3, 1, 2, 3, 2, 1]
MASK = torch.tensor([[t < n for t in range(3)] for n in LENGTHS])  # [6, 3]


def per_token(values):
    return torch.tensor(
        [[v if t < n else 0.0 for t in range(3)] for v, n in zip(values, LENGTHS, strict=True)]
    )


def test_registered_under_their_names():
    for name, fn in [("grpo", grpo), ("rloo", rloo), ("reinforce_pp", reinforce_pp)]:
        assert GROUP_ADVANTAGES.get(name) is fn
        assert name not in GAME_ADVANTAGES
    assert GROUP_ADVANTAGES.get("reinforce_pp_baseline") is reinforce_pp_baseline


def test_grpo_normalises_by_the_unbiased_group_std():
    adv, metrics = grpo(REWARDS, GROUPS, MASK)
    # group 7: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std7 = math.sqrt(1 / 3)
    assert std7 == pytest.approx(torch.tensor([1.0, 0.0, 0.0]).std().item())
    a_one, a_zero = (2 / 3) / (std7 + 1e-6), (-1 / 3) / (std7 + 1e-6)
    # group 3: all equal -> 0; group 9: one member -> 0
    close(adv, per_token([a_one, 0.0, a_zero, 0.0, 0.0, a_zero]))
    assert adv.dtype == torch.float64 and not adv.requires_grad
    close(metrics["reward_mean"], 10 / 6)
    close(metrics["reward_std"], REWARDS.std())
    close(metrics["zero_std_frac"], 2 / 3)  # groups 3 and 9 of three


def test_dr_grpo_only_centres():
    adv, _ = grpo(REWARDS, GROUPS, MASK, norm_std=False)
    close(adv, per_token([2 / 3, 0.0, -1 / 3, 0.0, 0.0, -1 / 3]))


def test_rloo_subtracts_the_mean_of_the_others():
    adv, metrics = rloo(REWARDS, GROUPS, MASK)
    # group 7: 1 - (0 + 0)/2 = 1; 0 - (1 + 0)/2 = -0.5. Equals k/(k-1) (r - mean) = 1.5 (r - 1/3)
    close(adv, per_token([1.0, 0.0, -0.5, 0.0, 0.0, -0.5]))
    close(metrics["reward_mean"], 10 / 6)


def test_token_returns_put_the_reward_on_the_last_valid_token():
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    token_r = torch.tensor([[-0.1, -0.2, -0.3, 9.0], [0.5, 0.0, 9.0, 9.0]])  # 9s are masked out
    g = token_returns(torch.tensor([1.0, -1.0]), mask, token_r)
    # row 0: R = [-0.1, -0.2, 0.7, 0] -> suffix sums [0.4, 0.5, 0.7, 0]
    # row 1: R = [0.5, -1, 0, 0]      -> [-0.5, -1, 0, 0]
    close(g, [[0.4, 0.5, 0.7, 0.0], [-0.5, -1.0, 0.0, 0.0]])
    g = token_returns(torch.tensor([1.0, -1.0]), mask, token_r, gamma=0.5)
    # row 0: G2 = 0.7, G1 = -0.2 + 0.35 = 0.15, G0 = -0.1 + 0.075 = -0.025
    close(g[0, :3], [-0.025, 0.15, 0.7])
    close(g[1, :2], [0.0, -1.0])


def test_token_returns_discount_across_mask_holes():
    g = token_returns(torch.tensor([1.0]), torch.tensor([[True, False, True]]), gamma=0.5)
    close(g, [[0.25, 0.5, 1.0]])


def test_reinforce_pp_whitens_over_all_valid_tokens_of_the_batch():
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    token_r = torch.tensor([[-0.1, -0.2, -0.3, 9.0], [0.5, 0.0, 9.0, 9.0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, -1.0], dtype=torch.float64)
    adv, metrics = reinforce_pp(rewards, torch.tensor([0, 0]), mask, token_rewards=token_r)
    g = torch.tensor([0.4, 0.5, 0.7, -0.5, -1.0], dtype=torch.float64)
    white = (g - g.mean()) / (g.std() + 1e-8)  # std with Bessel's correction
    close(adv, [[*white[:3].tolist(), 0.0], [*white[3:].tolist(), 0.0, 0.0]])
    close(metrics["return_mean"], g.mean())
    close(metrics["return_std"], g.std(unbiased=False))
    close(adv[mask].mean(), 0.0)


def test_reinforce_pp_baseline_centres_by_group_then_whitens_globally():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2])
    mask = torch.tensor([[True, False], [True, False], [True, True], [True, False], [True, True]])
    adv, _ = reinforce_pp_baseline(rewards, groups, mask)
    # centred: [0.5, -0.5, -0.5, 0.5, 0] (group 2 alone -> 0); returns per valid token:
    g = torch.tensor([0.5, -0.5, -0.5, -0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    white = (g - g.mean()) / (g.std() + 1e-8)
    close(adv[mask], white)
    close(adv[~mask], [0.0, 0.0, 0.0])


@pytest.mark.parametrize("fn", [grpo, rloo, reinforce_pp, reinforce_pp_baseline])
def test_shape_errors_name_the_argument(fn):
    with pytest.raises(ValueError, match="group_ids"):
        fn(REWARDS, GROUPS[:3], MASK)
    with pytest.raises(ValueError, match="mask"):
        fn(REWARDS, GROUPS, MASK[:2])


# Eight completions of one prompt that all score 0.1 (not exactly representable): summing them
# rounds, so a mean taken from the sum sits an ulp from 0.1 and leaves rounding noise that the
# division by a std of the same size blows up. Equal rewards must give exactly 0.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1 / 3])
@pytest.mark.parametrize("k", [7, 8, 16])
def test_equal_rewards_give_exactly_zero_advantage(dtype, value, k):
    rewards = torch.full((k,), value, dtype=dtype)
    groups = torch.zeros(k, dtype=torch.int64)
    mask = torch.ones(k, 3, dtype=torch.bool)
    zeros = torch.zeros(k, 3, dtype=dtype)
    for fn, kwargs in [
        (grpo, {}),
        (grpo, {"norm_std": False}),  # Dr. GRPO
        (rloo, {}),
        (reinforce_pp, {}),
        (reinforce_pp_baseline, {}),
    ]:
        adv, metrics = fn(rewards, groups, mask, **kwargs)
        assert torch.equal(adv, zeros), (fn.__name__, kwargs, adv[:, 0])
        assert metrics["reward_std"].item() == 0.0
        assert metrics["reward_mean"].item() == rewards[0].item()
        if fn is grpo:
            assert metrics["zero_std_frac"].item() == 1.0


def test_group_stats_of_equal_float32_rewards_are_exact():
    rewards = torch.tensor([0.1] * 8 + [0.1, 0.1, 0.1, 0.6], dtype=torch.float32)
    groups = torch.tensor([4] * 8 + [2] * 4)
    size, mean, std = group_stats(rewards, groups)
    assert size.tolist() == [8.0] * 8 + [4.0] * 4
    tenth = torch.tensor(0.1, dtype=torch.float32)
    assert torch.equal(mean[:8], tenth.expand(8)) and torch.equal(std[:8], torch.zeros(8))
    # group 2: mean (0.3 + 0.6) / 4 = 0.225; unbiased var (3 * 0.125^2 + 0.375^2) / 3 = 0.0625
    close(mean[8:], [0.225] * 4)
    close(std[8:], [0.25] * 4)


def test_grpo_counts_float32_equal_groups_as_zero_std():
    # group 0: eight times 0.1 -> all 0; group 1: [0.1, 0.1, 0.1, 0.6] -> mean 0.225, std 0.25
    rewards = torch.tensor([0.1] * 8 + [0.1, 0.1, 0.1, 0.6], dtype=torch.float32)
    groups = torch.tensor([0] * 8 + [1] * 4)
    adv, metrics = grpo(rewards, groups, torch.ones(12, 1, dtype=torch.bool))
    assert torch.equal(adv[:8], torch.zeros(8, 1))
    close(adv[8:, 0], [-0.125 / (0.25 + 1e-6)] * 3 + [0.375 / (0.25 + 1e-6)])
    assert metrics["zero_std_frac"].item() == 0.5
    adv, _ = rloo(rewards, groups, torch.ones(12, 1, dtype=torch.bool))
    # group 1: 0.1 - (0.1 + 0.1 + 0.6) / 3 = -1/6; 0.6 - 0.1 = 0.5
    assert torch.equal(adv[:8], torch.zeros(8, 1))
    close(adv[8:, 0], [-1 / 6] * 3 + [0.5])
