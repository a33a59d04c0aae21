"""V-trace (learner.algos.vtrace) against IMPALA's formula written out (Espeholt et al. 2018,
arXiv:1802.01561, eq. 1), on small tensors, in float64 Python loops:

    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) delta_t,
    delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),   V(x_T) = bootstrap,
    A_s = pg_rho_s (r_s + gamma_s v_{s+1} - V(x_s)),       v_T = bootstrap,

with rho_t = min(rho_bar, pi/mu), c_t = lam * min(c_bar, pi/mu), gamma_t = gamma (0 after a
termination): the direct sum, not the recursion the implementation runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.algos import GAME_ADVANTAGES, gae, resolve_game_preset, vtrace, vtrace_advantages


def paper(mu, pi, r, V, boot, disc, *, rho_bar=1.0, c_bar=1.0, lam=1.0, pg_rho_bar=None):
    """(vs, pg_advantages) as lists [T][N] of floats, by eq. (1) summed out term by term."""
    T, N = len(r), len(r[0])
    pg_rho_bar = rho_bar if pg_rho_bar is None else pg_rho_bar
    vs = [[0.0] * N for _ in range(T)]
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        ratio = [math.exp(pi[t][n] - mu[t][n]) for t in range(T)]
        v_next = [V[t + 1][n] if t + 1 < T else boot[n] for t in range(T)]
        delta = [min(rho_bar, ratio[t]) * (r[t][n] + disc[t][n] * v_next[t] - V[t][n])
                 for t in range(T)]  # fmt: skip
        for s in range(T):
            total, trace = V[s][n], 1.0
            for t in range(s, T):
                total += trace * delta[t]
                trace *= disc[t][n] * lam * min(c_bar, ratio[t])
            vs[s][n] = total
        for s in range(T):
            following = vs[s + 1][n] if s + 1 < T else boot[n]
            adv[s][n] = min(pg_rho_bar, ratio[s]) * (r[s][n] + disc[s][n] * following - V[s][n])
    return vs, adv


def _case(T=6, N=3, seed=0, terminate=((2, 0), (4, 2))):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(T, N, generator=g, dtype=torch.float64) * 0.5 - 1.0
    pi = mu + torch.randn(T, N, generator=g, dtype=torch.float64) * 0.6  # ratios ~0.3 .. 3
    r = torch.randn(T, N, generator=g, dtype=torch.float64)
    V = torch.randn(T, N, generator=g, dtype=torch.float64)
    boot = torch.randn(N, generator=g, dtype=torch.float64)
    terminated = torch.zeros(T, N, dtype=torch.bool)
    for t, n in terminate:
        terminated[t, n] = True
    disc = 0.9 * (~terminated).double()
    return mu, pi, r, V, boot, disc, terminated


@pytest.mark.parametrize(
    ("rho_bar", "c_bar", "lam", "pg_rho_bar"),
    [(1.0, 1.0, 1.0, None), (1.5, 0.8, 1.0, None), (1.0, 1.0, 0.7, 2.0), (0.5, 2.0, 0.9, None)],
)
def test_vtrace_matches_the_papers_sum_with_terminations(rho_bar, c_bar, lam, pg_rho_bar):
    mu, pi, r, V, boot, disc, _ = _case()
    out = vtrace(mu, pi, r, V, boot, disc, rho_bar=rho_bar, c_bar=c_bar, lam=lam,
                 pg_rho_bar=pg_rho_bar)  # fmt: skip
    want_vs, want_adv = paper(
        mu.tolist(), pi.tolist(), r.tolist(), V.tolist(), boot.tolist(), disc.tolist(),
        rho_bar=rho_bar, c_bar=c_bar, lam=lam, pg_rho_bar=pg_rho_bar,
    )  # fmt: skip
    assert out.vs.dtype == torch.float64
    torch.testing.assert_close(out.vs, torch.tensor(want_vs, dtype=torch.float64))
    torch.testing.assert_close(out.pg_advantages, torch.tensor(want_adv, dtype=torch.float64))
    torch.testing.assert_close(out.rhos, (pi - mu).exp())


def test_one_step_by_hand():
    # T = 1: v_0 = V + min(rho_bar, rho) (r + gamma b - V); the clip is what bounds it.
    mu, pi = torch.tensor([[0.0]]), torch.tensor([[math.log(3.0)]])  # rho = 3
    r, V, b = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([2.0])
    out = vtrace(mu, pi, r, V, b, torch.tensor([[0.9]]), rho_bar=1.0)
    torch.testing.assert_close(out.vs, torch.tensor([[0.5 + 1.0 * (1.0 + 0.9 * 2.0 - 0.5)]]))
    torch.testing.assert_close(out.pg_advantages, torch.tensor([[1.0 + 0.9 * 2.0 - 0.5]]))
    out = vtrace(mu, pi, r, V, b, torch.tensor([[0.9]]), rho_bar=2.0)
    torch.testing.assert_close(out.vs, torch.tensor([[0.5 + 2.0 * (1.0 + 0.9 * 2.0 - 0.5)]]))


def test_truncation_bootstraps_like_a_fragment_ending_there():
    # Env 1 is cut by the time limit at t = 2: the first 3 steps are a fragment bootstrapped from
    # V(final observation), the rest one of its own; env 0 runs through.
    mu, pi, r, V, boot, disc, _ = _case(T=6, N=2, seed=3, terminate=())
    truncated = torch.zeros(6, 2, dtype=torch.bool)
    truncated[2, 1] = True
    final_values = torch.full((6, 2), math.nan, dtype=torch.float64)
    final_values[2, 1] = 7.0
    out = vtrace(mu, pi, r, V, boot, disc, truncated=truncated, final_values=final_values,
                 c_bar=0.9, lam=0.95)  # fmt: skip
    head = vtrace(mu[:3, 1:], pi[:3, 1:], r[:3, 1:], V[:3, 1:], torch.tensor([7.0]).double(),
                  disc[:3, 1:], c_bar=0.9, lam=0.95)  # fmt: skip
    tail = vtrace(mu[3:, 1:], pi[3:, 1:], r[3:, 1:], V[3:, 1:], boot[1:], disc[3:, 1:],
                  c_bar=0.9, lam=0.95)  # fmt: skip
    whole = vtrace(mu[:, :1], pi[:, :1], r[:, :1], V[:, :1], boot[:1], disc[:, :1],
                   c_bar=0.9, lam=0.95)  # fmt: skip
    torch.testing.assert_close(out.vs[:, 1:], torch.cat([head.vs, tail.vs]))
    torch.testing.assert_close(out.pg_advantages[:, 1:],
                               torch.cat([head.pg_advantages, tail.pg_advantages]))  # fmt: skip
    torch.testing.assert_close(out.vs[:, :1], whole.vs)
    assert torch.isfinite(out.vs).all()  # the NaN of final_values elsewhere is never read


def test_truncation_needs_final_values():
    mu, pi, r, V, boot, disc, _ = _case(T=3, N=1, terminate=())
    truncated = torch.tensor([[False], [True], [False]])
    with pytest.raises(ValueError, match="final_values"):
        vtrace(mu, pi, r, V, boot, disc, truncated=truncated)


@pytest.mark.parametrize("clip", [1.0, 2.5])
def test_on_policy_equals_gae_lambda_one(clip):
    # pi = mu, clips >= 1: v_s is the n-step bootstrapped return and A_s GAE(lambda=1)'s
    # advantage, terminations and a truncation included (IMPALA, section 4.1).
    _, _, r, V, boot, _, terminated = _case(T=7, N=3, seed=5, terminate=((1, 0), (5, 1)))
    truncated = torch.zeros_like(terminated)
    truncated[3, 2] = True
    final_values = torch.zeros(7, 3, dtype=torch.float64)
    final_values[3, 2] = -1.5
    logp = torch.full((7, 3), -0.7, dtype=torch.float64)
    adv, vs = vtrace_advantages(
        r, V, terminated=terminated, truncated=truncated, last_value=boot,
        final_values=final_values, gamma=0.97, lam=1.0, behaviour_logp=logp, target_logp=logp,
        rho_bar=clip, c_bar=clip,
    )  # fmt: skip
    gae_adv, gae_returns = gae(
        r, V, terminated=terminated, truncated=truncated, last_value=boot,
        final_values=final_values, gamma=0.97, lam=1.0,
    )  # fmt: skip
    torch.testing.assert_close(vs, gae_returns)
    torch.testing.assert_close(adv, gae_adv)
    # ... and v_s = r_s + gamma r_{s+1} + ... + gamma^k V(x_end): env 0 from t = 2 on.
    g = 0.97
    n_step = sum(g**k * float(r[2 + k, 0]) for k in range(5)) + g**5 * float(boot[0])
    assert float(vs[2, 0]) == pytest.approx(n_step)


def test_on_policy_targets_are_gae_lambda_returns():
    # With lam < 1 the on-policy traces are lam, so v_s is GAE(lam)'s lambda-return.
    _, _, r, V, boot, _, terminated = _case(T=6, N=2, seed=9, terminate=((3, 1),))
    none = torch.zeros_like(terminated)
    _, vs = vtrace_advantages(r, V, terminated=terminated, truncated=none, last_value=boot,
                              gamma=0.9, lam=0.8)  # fmt: skip
    _, returns = gae(r, V, terminated=terminated, truncated=none, last_value=boot, gamma=0.9,
                     lam=0.8)  # fmt: skip
    torch.testing.assert_close(vs, returns)


def test_bad_input_names_what_is_wrong():
    mu, pi, r, V, boot, disc, _ = _case(T=4, N=2, terminate=())
    with pytest.raises(ValueError, match="target_logp must match rewards"):
        vtrace(mu, pi[:3], r, V, boot, disc)
    with pytest.raises(ValueError, match="bootstrap_value must be"):
        vtrace(mu, pi, r, V, boot[:1], disc)
    with pytest.raises(ValueError, match="clip thresholds"):
        vtrace(mu, pi, r, V, boot, disc, c_bar=0.0)
    none = torch.zeros(4, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="both behaviour_logp and target_logp"):
        vtrace_advantages(r, V, terminated=none, truncated=none, last_value=boot,
                          behaviour_logp=mu)  # fmt: skip


def test_registered_like_gae_and_named_by_the_appo_preset():
    assert GAME_ADVANTAGES.get("vtrace") is vtrace_advantages
    preset = resolve_game_preset("appo")
    assert (preset.advantage, preset.policy_loss) == ("vtrace", "ppo")
    assert preset.advantage_kwargs == {"rho_bar": 1.0, "c_bar": 1.0}


def test_the_appo_job_kind_expands_to_a_v_trace_learner(tmp_path):
    from services.config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("run: {name: r}\njob:\n  kind: appo\n  env_id: CartPole-v1\n")
    config = load_run_config(path, environ={})
    learner = config.service("learner").settings
    assert (learner.algo, learner.max_policy_lag) == ("appo", 4)
    assert learner.game_preset.advantage == "vtrace"
    path.write_text(
        "run: {name: r}\njob:\n  kind: appo\n  env_id: CartPole-v1\n  max_policy_lag: 0\n"
    )
    with pytest.raises(Exception, match="max_policy_lag"):
        load_run_config(path, environ={})
