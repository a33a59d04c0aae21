"""The LM learner's pure parts on a tiny real model: group decoding, batch layout, one update per
preset, and that a GRPO update moves probability towards the rewarded completion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import tensor
from learner.algos import PRESETS
from learner.algos.presets import resolve_preset
from learner.lm.batch import collate, decode_group
from learner.lm.model import load_causal_lm, load_tokenizer, sequence_logprobs
from learner.lm.update import group_filter, lm_update, minibatch_loss, prepare
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.reward.v1 import reward_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument


class PlainEngine:
    """The Engine surface lm_update uses, over a plain module and AdamW (no DeepSpeed: the
    engine itself is covered by the learner integration tests)."""

    def __init__(self, module: torch.nn.Module, lr: float = 1e-3) -> None:
        self.module = module
        self.opt = torch.optim.AdamW(module.parameters(), lr=lr)

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def accumulation_boundary(self, last: bool) -> None:
        """Plain autograd accumulates in ``.grad`` by itself."""

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def _group(tok, model, prompt: str, answers: list[str], rewards: list[float], gid: str, version=0):
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    msg = trajectory_pb2.TrajectoryGroup(
        run="t", group_id=gid, prompt_id=gid, policy_version=version,
        prompt_token_ids=tensor.encode(np.asarray(prompt_ids, np.int32)),
    )  # fmt: skip
    for text, reward in zip(answers, rewards, strict=True):
        ids = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        full = torch.tensor([prompt_ids + ids])
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, full, torch.ones_like(full))
        comp_logp = logp[0, len(prompt_ids) - 1 :].numpy().astype(np.float32)
        msg.completions.append(
            trajectory_pb2.TrajectoryCompletion(
                token_ids=tensor.encode(np.asarray(ids, np.int32)),
                logprobs=tensor.encode(comp_logp),
                finish_reason=sampler_pb2.FINISH_REASON_STOP,
                reward=reward,
                policy_version=version,
                end_policy_version=version,
                text=text,
                rewards=[
                    reward_pb2.FunctionScore(
                        name="accuracy", status=reward_pb2.SCORE_STATUS_OK, score=reward
                    )
                ],
            )
        )
    return msg


@pytest.fixture(scope="module")
def tok_model(tiny_model_dir):
    torch.manual_seed(0)
    return load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir)


def test_decode_and_collate_layout(tok_model):
    tok, model = tok_model
    msg = _group(tok, model, "Q: 1+2=?\nA:", [" <answer>3</answer>", " 7"], [1.0, 0.0], "g0")
    samples = decode_group(msg, vocab_size=len(tok))
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert samples[0].scores == {"accuracy": 1.0}
    batch = collate(samples, tok.pad_token_id)
    p = len(samples[0].prompt_ids)
    for row, s in enumerate(samples):
        c = len(s.completion_ids)
        # position p-1+j scores completion token j: the mask covers exactly those positions
        assert batch.mask[row].nonzero().squeeze(-1).tolist() == list(range(p - 1, p - 1 + c))
        assert torch.equal(batch.input_ids[row, p : p + c], torch.from_numpy(s.completion_ids))
        assert torch.allclose(
            batch.rollout_logp[row, p - 1 : p - 1 + c], torch.from_numpy(s.rollout_logp)
        )
    # the sampler's log-probs are the model's own: recomputing them gives the same numbers
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    assert torch.allclose(logp[batch.mask], batch.rollout_logp[batch.mask], atol=1e-5)


def test_decode_rejects_bad_groups(tok_model):
    tok, model = tok_model
    msg = _group(tok, model, "Q: 1+2=?\nA:", [" 3"], [1.0], "g0")
    bad = trajectory_pb2.TrajectoryGroup()
    bad.CopyFrom(msg)
    bad.completions[0].token_ids.CopyFrom(tensor.encode(np.asarray([1.5, 2.0], np.float32)))
    with pytest.raises(InvalidArgument, match=r"completions\[0\]\.token_ids: expected int32"):
        decode_group(bad, len(tok))
    bad.CopyFrom(msg)
    bad.completions[0].logprobs.CopyFrom(tensor.encode(np.zeros(7, np.float32)))
    with pytest.raises(InvalidArgument, match=r"completions\[0\]\.logprobs: shape"):
        decode_group(bad, len(tok))
    bad.CopyFrom(msg)
    bad.completions[0].token_ids.CopyFrom(tensor.encode(np.asarray([10**6], np.int32)))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        decode_group(bad, len(tok))
    bad.CopyFrom(msg)
    bad.completions[0].reward = float("nan")
    with pytest.raises(InvalidArgument, match=r"completions\[0\]\.reward: not finite"):
        decode_group(bad, len(tok))


def test_dynamic_sampling_drops_uniform_groups(tok_model):
    tok, model = tok_model
    uniform = decode_group(_group(tok, model, "Q: 1+1=?\nA:", [" 2", " 3"], [0.0, 0.0], "u"), 999)
    mixed = decode_group(_group(tok, model, "Q: 1+1=?\nA:", [" 2", " 3"], [1.0, 0.0], "m"), 999)
    dapo, grpo = resolve_preset("dapo"), resolve_preset("grpo")
    assert group_filter(uniform, dapo) == ([], "uniform")
    assert group_filter(uniform, grpo)[1] is None
    assert group_filter(mixed, dapo)[1] is None


@pytest.mark.slow  # every preset trains the tiny LM (about a minute): not in `make test-fast`
@pytest.mark.parametrize("preset", sorted(PRESETS.names()))
def test_every_preset_updates(tok_model, preset):
    tok, base = tok_model
    model = load_causal_lm_copy(base)
    p = resolve_preset(preset)
    reference = load_causal_lm_copy(base).eval() if p.kl_beta > 0 else None
    samples = []
    for g in range(2):
        msg = _group(
            tok, model, f"Q: {g}+1=?\nA:", [f" <answer>{g + 1}</answer>", " 5", " 9"],
            [1.0, 0.0, 0.5], f"g{g}",
        )  # fmt: skip
        samples += decode_group(msg, len(tok))
    if p.chord:
        expert = _group(tok, model, "Q: 2+2=?\nA:", [" <answer>4</answer>"], [1.0], "e")
        expert.completions[0].expert = True
        expert.completions[0].ClearField("logprobs")
        samples += decode_group(expert, len(tok))
    metrics = lm_update(
        PlainEngine(model), reference, samples, p, pad_id=tok.pad_token_id, lr=1e-3, step=0,
        minibatch_size=4,
    )  # fmt: skip
    assert np.isfinite(metrics["losses/policy_loss"]) and np.isfinite(metrics["losses/loss"])
    assert "losses/approx_kl" in metrics and "charts/entropy" in metrics
    assert metrics["rollout/mismatch_kl"] == pytest.approx(0.0, abs=1e-5)  # same weights
    if p.kl_beta > 0 and not p.kl_in_reward:
        assert "losses/kl" in metrics
    if p.chord:
        assert metrics["charts/chord_mu"] == pytest.approx(p.chord_mu(0))


def load_causal_lm_copy(model):
    import copy

    return copy.deepcopy(model).train()


def test_grpo_moves_probability_to_rewarded_completion(tok_model):
    tok, base = tok_model
    model = load_causal_lm_copy(base)
    engine = PlainEngine(model, lr=3e-3)
    preset = resolve_preset("grpo", kl_beta=0.0)
    good, bad = " <answer>3</answer>", " <answer>7</answer>"

    def logp_of(text: str) -> float:
        msg = _group(tok, model, "Q: 1+2=?\nA:", [text], [0.0], "x")
        return float(decode_group(msg, len(tok))[0].rollout_logp.sum())

    before = logp_of(good) - logp_of(bad)
    for step in range(5):
        msg = _group(tok, model, "Q: 1+2=?\nA:", [good, bad, good, bad], [1, 0, 1, 0], f"s{step}")
        lm_update(engine, None, decode_group(msg, len(tok)), preset, pad_id=0, lr=3e-3, step=step)
    assert logp_of(good) - logp_of(bad) > before + 1.0


def test_policy_loss_is_the_policy_gradient_term_and_loss_the_total(tok_model):
    """As on the game side (and CleanRL): ``losses/policy_loss`` is the policy-gradient term,
    ``losses/loss`` what is minimised (here with the KL term added)."""
    tok, base = tok_model
    model = load_causal_lm_copy(base)
    preset = resolve_preset("grpo", kl_beta=0.5, entropy_coef=0.0)
    msg = _group(tok, model, "Q: 1+2=?\nA:", [" 3", " 4", " 5"], [1.0, 0.0, 0.5], "g")
    samples = decode_group(msg, len(tok))
    reference = load_causal_lm_copy(base).eval()
    with torch.no_grad():  # a reference that differs, so the KL term is not 0
        for param in reference.parameters():
            param.add_(0.01 * torch.randn_like(param))
    engine = PlainEngine(model)
    prep = prepare(engine, reference, samples, preset, pad_id=tok.pad_token_id, minibatch_size=2)
    assert not prep.adv.requires_grad and prep.ref_logp is not None
    assert prep.metrics["rollout/mismatch_kl"] == pytest.approx(0.0, abs=1e-5)
    loss, metrics, chord = minibatch_loss(engine, prep, torch.arange(len(samples)), preset, 0)
    assert loss.requires_grad and chord == {}
    assert metrics["losses/kl"] > 0
    want = metrics["losses/policy_loss"] + preset.kl_beta * metrics["losses/kl"]
    assert metrics["losses/loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)

    out = lm_update(
        engine, reference, samples, preset, pad_id=tok.pad_token_id, lr=1e-3, step=0,
        minibatch_size=len(samples),
    )  # fmt: skip
    want = out["losses/policy_loss"] + preset.kl_beta * out["losses/kl"]
    assert out["losses/loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)


class CountingEngine(PlainEngine):
    """PlainEngine that counts the sequences it runs forward (to see the skipped passes)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.rows = 0

    def __call__(self, **kwargs):
        self.rows += int(kwargs["input_ids"].shape[0])
        return super().__call__(**kwargs)


def _moved(base, scale: float):
    """A copy of ``base`` whose weights moved (the learner one update after the sampler's)."""
    model = load_causal_lm_copy(base)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=gen))
    return model


def _stale_batch(tok, base):
    """Two groups sampled by version 0 (``base``'s log-probs recorded, as the sampler does)."""
    samples = []
    for g, answers in enumerate(([" 3", " 4", " 5"], [" <answer>2</answer>", " 9", " 1"])):
        msg = _group(tok, base, f"Q: {g}+2=?\nA:", answers, [1.0, 0.0, 0.5], f"g{g}", version=0)
        samples += decode_group(msg, len(tok))
    return samples


def test_stale_batch_ratio_is_against_the_sampler_logprobs(tok_model):
    """The written-out GRPO objective of a batch one version old (``old_logp: auto``): ratio
    ``exp(log pi_theta - log pi_behaviour)``, advantage ``(r - mean_g) / (std_g + 1e-6)``,
    loss ``max(-A r, -A clip(r, 0.8, 1.2))`` averaged over each sequence's tokens, then over
    the sequences; clip fraction the share of tokens with r outside [0.8, 1.2]."""
    tok, base = tok_model
    samples = _stale_batch(tok, base)
    model = _moved(base, 0.05)  # the learner's weights at version 1
    preset = resolve_preset("grpo", kl_beta=0.0)
    engine = CountingEngine(model)
    prep = prepare(engine, None, samples, preset, pad_id=tok.pad_token_id, version=1)
    assert engine.rows == 0  # every row is stale: no forward pass for pi_old
    m = prep.mask
    assert torch.equal(prep.old_logp[m], prep.batch.rollout_logp[m])
    assert float(prep.metrics["rollout/stale_frac"]) == 1.0
    assert "rollout/mismatch_kl" not in prep.metrics  # nothing recomputed to compare with

    loss, metrics, _ = minibatch_loss(engine, prep, torch.arange(len(samples)), preset, 0)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, prep.batch.input_ids, prep.batch.attention_mask)
        ratio = torch.exp(logp - prep.batch.rollout_logp)
        rewards = torch.tensor([s.reward for s in samples]).view(2, 3)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
        adv = adv.reshape(-1, 1)
        tok_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        want = ((tok_loss * m).sum(1) / m.sum(1)).mean()
        clipfrac = ((ratio < 0.8) | (ratio > 1.2))[m].float().mean()
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-4)
    assert metrics["losses/clipfrac"] == pytest.approx(float(clipfrac))
    assert metrics["losses/clipfrac"] > 0  # the policy moved past the clip range on some tokens
    assert abs(metrics["losses/ratio_mean"] - 1.0) > 1e-3


def test_recompute_trains_a_stale_batch_as_if_on_policy(tok_model):
    """``old_logp: recompute`` (the previous behaviour): ratio 1 and clip fraction 0 on the same
    stale batch, and the mismatch statistics hold the policy's move."""
    tok, base = tok_model
    samples = _stale_batch(tok, base)
    engine = CountingEngine(_moved(base, 0.05))
    preset = resolve_preset("grpo", kl_beta=0.0, old_logp="recompute")
    prep = prepare(engine, None, samples, preset, pad_id=tok.pad_token_id, version=1)
    assert engine.rows == len(samples)
    _, metrics, _ = minibatch_loss(engine, prep, torch.arange(len(samples)), preset, 0)
    assert metrics["losses/clipfrac"] == 0.0
    assert metrics["losses/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert float(prep.metrics["rollout/mismatch_kl"]) > 1e-3


def test_auto_recomputes_fresh_rows_only_and_caps_their_mismatch(tok_model):
    """Fresh rows get pi_old from the learner (ratio starts at 1) and the truncated-IS weights
    ``min(exp(pi_learner - pi_sampler), cap)``; stale rows keep the sampler's log-probs."""
    tok, base = tok_model
    model = _moved(base, 0.05)  # learner at version 1
    stale = _stale_batch(tok, base)  # sampled by version 0
    fresh_msg = _group(tok, base, "Q: 5+2=?\nA:", [" 7", " 8"], [1.0, 0.0], "f", version=1)
    fresh = decode_group(fresh_msg, len(tok))  # base's log-probs, but labelled version 1
    engine = CountingEngine(model)
    preset = resolve_preset("grpo", kl_beta=0.0, tis_cap=1.5)
    samples = stale + fresh
    prep = prepare(engine, None, samples, preset, pad_id=tok.pad_token_id, version=1)
    assert engine.rows == len(fresh)
    m, rows = prep.mask, torch.arange(len(stale), len(samples))
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, prep.batch.input_ids, prep.batch.attention_mask)
    assert torch.allclose(prep.old_logp[rows][m[rows]], logp[rows][m[rows]], atol=1e-5)
    want_w = torch.exp(logp - prep.batch.rollout_logp).clamp(max=1.5)
    assert torch.allclose(prep.tis[rows][m[rows]], want_w[rows][m[rows]], atol=1e-5)
    assert bool((prep.tis[: len(stale)] == 1).all())
    assert float(prep.metrics["rollout/stale_frac"]) == pytest.approx(len(stale) / len(samples))


def test_tis_cap_needs_a_recomputed_old_logp():
    with pytest.raises(ValueError, match="tis_cap weights rows whose pi_old the learner"):
        resolve_preset("grpo", old_logp="behaviour", tis_cap=2.0)
    with pytest.raises(ValueError, match="old_logp"):
        resolve_preset("grpo", old_logp="sampler")
