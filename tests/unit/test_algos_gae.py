"""GAE and discounted returns against values written out by hand (Schulman et al. 2016)."""

import math

import pytest
import torch

from learner.algos import GAME_ADVANTAGES, GROUP_ADVANTAGES, discounted_returns, gae

GAMMA, LAM = 0.9, 0.8  # gamma * lam = 0.72

# One env, three steps: r = [1, 2, 3], V(s_t) = [0.5, 1.0, 1.5], V(s_3) = last_value = 2.0.
REWARDS = [1.0, 2.0, 3.0]
VALUES = [0.5, 1.0, 1.5]
LAST = 2.0


def col(xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype).reshape(-1, 1)  # [T, 1]


def flags(*steps, t=3):
    return torch.tensor([i in steps for i in range(t)]).reshape(-1, 1)  # [T, 1] bool


def run(terminated=(), truncated=(), final_values=None, **kw):
    kw = {"gamma": GAMMA, "lam": LAM, **kw}
    return gae(
        col(REWARDS),
        col(VALUES),
        terminated=flags(*terminated),
        truncated=flags(*truncated),
        last_value=torch.tensor([LAST]),
        final_values=None if final_values is None else col(final_values),
        **kw,
    )


def assert_close(actual, expected):
    torch.testing.assert_close(actual, col(expected), rtol=0, atol=1e-5)


def test_no_episode_end_bootstraps_from_last_value():
    # delta_2 = 3 + 0.9 * 2.0 - 1.5 = 3.3
    # delta_1 = 2 + 0.9 * 1.5 - 1.0 = 2.35
    # delta_0 = 1 + 0.9 * 1.0 - 0.5 = 1.4
    # A_2 = 3.3; A_1 = 2.35 + 0.72 * 3.3 = 4.726; A_0 = 1.4 + 0.72 * 4.726 = 4.80272
    adv, ret = run()
    assert_close(adv, [4.80272, 4.726, 3.3])
    assert_close(ret, [4.80272 + 0.5, 4.726 + 1.0, 3.3 + 1.5])


def test_termination_mid_fragment_does_not_bootstrap():
    # terminated at t=1: delta_1 = 2 + 0 - 1.0 = 1.0, A_1 = 1.0 (nothing carried back across it)
    # A_2 = 3.3 (new episode, fragment end); A_0 = 1.4 + 0.72 * 1.0 = 2.12
    adv, ret = run(terminated=[1])
    assert_close(adv, [2.12, 1.0, 3.3])
    assert_close(ret, [2.62, 2.0, 4.8])


def test_truncation_mid_fragment_bootstraps_from_final_value():
    # truncated at t=1 with V(final obs) = 4.0: delta_1 = 2 + 0.9 * 4.0 - 1.0 = 4.6, A_1 = 4.6
    # A_0 = 1.4 + 0.72 * 4.6 = 4.712; A_2 = 3.3. Entries of final_values off truncated steps are
    # ignored, even NaN.
    adv, ret = run(truncated=[1], final_values=[math.nan, 4.0, math.nan])
    assert_close(adv, [4.712, 4.6, 3.3])
    assert_close(ret, [5.212, 5.6, 4.8])


def test_truncation_without_final_values_is_an_error():
    with pytest.raises(ValueError, match="final_values"):
        run(truncated=[1])


def test_bootstrap_truncated_false_treats_truncation_as_termination():
    adv, _ = run(truncated=[1], final_values=[0.0, 4.0, 0.0], bootstrap_truncated=False)
    assert_close(adv, [2.12, 1.0, 3.3])


def test_termination_wins_over_truncation():
    adv, _ = run(terminated=[1], truncated=[1], final_values=[0.0, 4.0, 0.0])
    assert_close(adv, [2.12, 1.0, 3.3])


def test_done_on_last_step_ignores_last_value():
    # terminated at t=2: delta_2 = 3 - 1.5 = 1.5; A_1 = 2.35 + 0.72 * 1.5 = 3.43
    # A_0 = 1.4 + 0.72 * 3.43 = 3.8696
    adv, _ = run(terminated=[2])
    assert_close(adv, [3.8696, 3.43, 1.5])
    # truncated at t=2 with V(final) = 10: delta_2 = 3 + 9 - 1.5 = 10.5; A_1 = 2.35 + 7.56 = 9.91
    # A_0 = 1.4 + 0.72 * 9.91 = 8.5352
    adv, _ = run(truncated=[2], final_values=[0.0, 0.0, 10.0])
    assert_close(adv, [8.5352, 9.91, 10.5])


def test_envs_are_independent_columns():
    # env 0: no end; env 1: terminated at t=1. Same numbers as the single-env cases above.
    rewards = torch.tensor([REWARDS, REWARDS]).T  # [3, 2]
    values = torch.tensor([VALUES, VALUES]).T
    terminated = torch.tensor([[False, False], [False, True], [False, False]])
    adv, _ = gae(
        rewards,
        values,
        terminated=terminated,
        truncated=torch.zeros(3, 2, dtype=torch.bool),
        last_value=torch.tensor([LAST, LAST]),
        gamma=GAMMA,
        lam=LAM,
    )
    expected = torch.tensor([[4.80272, 2.12], [4.726, 1.0], [3.3, 3.3]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)


def test_lambda_zero_is_td_error_and_lambda_one_is_discounted_return():
    adv, _ = run(lam=0.0)
    assert_close(adv, [1.4, 2.35, 3.3])
    # lam = 1, V = 0: A_t is the discounted return. gamma = 0.5, last value 4:
    # G_2 = 3 + 0.5 * 4 = 5; G_1 = 2 + 0.5 * 5 = 4.5; G_0 = 1 + 0.5 * 4.5 = 3.25
    zeros = torch.zeros(3, 1, dtype=torch.bool)
    adv, ret = gae(
        col(REWARDS),
        torch.zeros(3, 1),
        terminated=zeros,
        truncated=zeros,
        last_value=torch.tensor([4.0]),
        gamma=0.5,
        lam=1.0,
    )
    assert_close(adv, [3.25, 4.5, 5.0])
    assert_close(ret, [3.25, 4.5, 5.0])
    assert_close(
        discounted_returns(col(REWARDS), zeros, gamma=0.5, last_value=torch.tensor([4.0])),
        [3.25, 4.5, 5.0],
    )


def test_discounted_returns_stops_at_done():
    # done at t=1: G_1 = 2; G_0 = 1 + 0.5 * 2 = 2; G_2 = 3 (no last value)
    assert_close(discounted_returns(col(REWARDS), flags(1), gamma=0.5), [2.0, 2.0, 3.0])


def test_no_gradient_and_dtype():
    values = col(VALUES, torch.float64).requires_grad_()
    zeros = torch.zeros(3, 1, dtype=torch.bool)
    adv, ret = gae(
        col(REWARDS), values, terminated=zeros, truncated=zeros, last_value=torch.tensor([LAST])
    )
    assert not adv.requires_grad and not ret.requires_grad
    assert adv.dtype == torch.float64


def test_shape_errors():
    zeros = torch.zeros(3, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="values"):
        gae(col(REWARDS), torch.zeros(3, 2), terminated=zeros, truncated=zeros,
            last_value=torch.zeros(1))  # fmt: skip
    with pytest.raises(ValueError, match="last_value"):
        gae(col(REWARDS), col(VALUES), terminated=zeros, truncated=zeros,
            last_value=torch.zeros(3))  # fmt: skip
    with pytest.raises(ValueError, match="gamma"):
        run(gamma=1.5)


def test_registered_as_gae():
    assert GAME_ADVANTAGES.get("gae") is gae
    assert "gae" not in GROUP_ADVANTAGES  # another family: a GRPO preset cannot name it
