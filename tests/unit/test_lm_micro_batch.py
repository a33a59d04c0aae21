"""``micro_batch_size`` in the LM update: a minibatch run as micro-batches (gradients accumulated
into its one optimizer step) trains exactly as the minibatch at once, for every aggregation the
presets use, and no forward pass sees more than ``micro_batch_size`` sequences."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from learner.algos.presets import resolve_preset
from learner.lm.batch import Sample, decode_group
from learner.lm.jobs import LM_JOBS
from learner.lm.settings import LMLearnerSettings
from learner.lm.update import lm_update
from tests.unit.test_lm_learner import (
    PlainEngine,
    _group,
    _moved,
    load_causal_lm_copy,
    tok_model,
)

__all__ = ["tok_model"]  # the shared fixture (a tiny real model and its tokenizer)

MINIBATCH, MICRO = 8, 2  # micro-batches of a quarter of the minibatch

# One case per aggregation the presets use (and CHORD's SFT term, an entropy bonus and the KL
# loss term on top): (preset, overrides).
CASES = {
    "grpo": ("grpo", {"entropy_coef": 0.01}),  # seq-mean-token-mean, KL loss term, entropy
    "dapo": ("dapo", {}),  # token-mean, overlong filter
    "dr_grpo": ("dr_grpo", {}),  # seq-mean-token-sum-norm (norm: the padded length)
    "dr_grpo_norm": ("dr_grpo", {"aggregation_kwargs": {"norm": 16.0}}),
    "gspo": ("gspo", {}),  # sequence-level ratio, seq-mean-token-mean
    "chord": ("chord", {}),  # token-mean + the SFT term on expert rows
}

ANSWERS = [  # completions of different lengths, so micro-batches hold different token counts
    " <answer>3</answer>",
    " 5",
    " <answer>12</answer> because 7 and 5",
    " 9 9",
]


class SGDEngine(PlainEngine):
    """PlainEngine over SGD (whose step is the gradient itself, unlike Adam's first step, which
    is its sign), recording each step's gradient."""

    def __init__(self, module: torch.nn.Module, lr: float = 0.05) -> None:
        super().__init__(module)
        self.opt = torch.optim.SGD(module.parameters(), lr=lr)
        self.grads: list[torch.Tensor] = []

    def step(self) -> None:
        self.grads.append(_flat_grads(self.module.parameters()))
        super().step()


def _flat_grads(params: Iterator[torch.nn.Parameter] | list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten().clone() for p in params if p.grad is not None])


def _flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _samples(tok, base, chord: bool) -> list[Sample]:
    """Four groups of four completions sampled by version 0 (``base``), rewards that differ
    within each group; with ``chord`` a group of expert completions too."""
    samples = []
    for g in range(4):
        rewards = [1.0, 0.0, 0.5, 0.25] if g % 2 else [0.0, 1.0, 0.0, 0.75]
        msg = _group(tok, base, f"Q: {g}+3=?\nA:", ANSWERS, rewards, f"g{g}", version=0)
        samples += decode_group(msg, len(tok))
    if chord:
        expert = _group(tok, base, "Q: 2+2=?\nA:", ANSWERS, [1.0] * 4, "e", version=0)
        for completion in expert.completions:
            completion.expert = True
            completion.ClearField("logprobs")
        samples += decode_group(expert, len(tok))
    return samples


def _update(engine, reference, samples, preset, micro: int | None) -> dict[str, float]:
    return lm_update(
        engine, reference, samples, preset, pad_id=0, lr=0.05, step=3, epochs=1,
        minibatch_size=MINIBATCH, micro_batch_size=micro, version=1,
        generator=torch.Generator().manual_seed(7),
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_micro_batches_train_as_the_whole_minibatch(tok_model, case):
    tok, base = tok_model
    name, overrides = CASES[case]
    preset = resolve_preset(name, **overrides)
    samples = _samples(tok, base, preset.chord)
    learner = _moved(base, 0.01)  # version 1: the batch is stale, ratios differ from 1
    reference = load_causal_lm_copy(base).eval() if preset.kl_beta > 0 else None
    engines, metrics = {}, {}
    for micro in (None, MICRO):
        engine = SGDEngine(load_causal_lm_copy(learner))
        engines[micro], metrics[micro] = engine, _update(engine, reference, samples, preset, micro)
    whole, split = engines[None], engines[MICRO]
    assert len(whole.grads) == len(split.grads) == -(-len(samples) // MINIBATCH)  # one step each
    for g_whole, g_split in zip(whole.grads, split.grads, strict=True):
        assert float(g_whole.abs().max()) > 1e-4  # a real gradient
        torch.testing.assert_close(g_split, g_whole, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(
        _flat_params(split.module), _flat_params(whole.module), rtol=1e-5, atol=1e-7
    )
    assert metrics[MICRO].keys() == metrics[None].keys()
    for key, value in metrics[None].items():
        assert metrics[MICRO][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_unscaled_micro_batch_losses_would_differ(tok_model):
    """The check above can fail: summing micro-batch means unweighted (the naive accumulation)
    gives another gradient on this batch."""
    tok, base = tok_model
    preset = resolve_preset("dapo")
    samples = _samples(tok, base, chord=False)[:MINIBATCH]
    learner = _moved(base, 0.01)
    whole = SGDEngine(load_causal_lm_copy(learner))
    _update(whole, None, samples, preset, None)

    naive = SGDEngine(load_causal_lm_copy(learner))
    from learner.lm import update

    original = update._share
    try:  # every micro-batch weighed 1/4, whatever its token count
        update._share = lambda mode, part, whole: 1.0 if whole is None else MICRO / MINIBATCH
        _update(naive, None, samples, preset, MICRO)
    finally:
        update._share = original
    assert not torch.allclose(naive.grads[0], whole.grads[0], rtol=1e-3, atol=1e-6)


def test_no_forward_pass_sees_more_than_micro_batch_size_rows(tok_model):
    """Every forward pass (pi_old recomputed, the reference's log-probs, the training passes)
    runs at most ``micro_batch_size`` sequences, so the largest activation (the logits) is a
    micro-batch's; without it the training passes run the whole minibatch."""
    tok, base = tok_model
    preset = resolve_preset("grpo", old_logp="recompute")  # KL: a reference pass too
    samples = _samples(tok, base, chord=False)
    learner, reference = load_causal_lm_copy(base), load_causal_lm_copy(base).eval()
    seen: list[tuple[str, int, int]] = []

    def recorder(name: str):
        def hook(module, args, kwargs, output):
            seen.append((name, int(kwargs["input_ids"].shape[0]), output.logits.numel()))

        return hook

    learner.register_forward_hook(recorder("policy"), with_kwargs=True)
    reference.register_forward_hook(recorder("reference"), with_kwargs=True)
    engine = SGDEngine(learner)
    lm_update(
        engine, reference, samples, preset, pad_id=0, lr=1e-3, step=0,
        minibatch_size=MINIBATCH, micro_batch_size=MICRO,
    )  # fmt: skip
    assert {name for name, _, _ in seen} == {"policy", "reference"}
    assert max(rows for _, rows, _ in seen) == MICRO
    assert sum(rows for name, rows, _ in seen if name == "reference") == len(samples)
    # pi_old recomputed for every row, then one training pass over every row
    assert sum(rows for name, rows, _ in seen if name == "policy") == 2 * len(samples)
    micro_logits = max(numel for _, _, numel in seen)

    seen.clear()
    lm_update(
        engine, reference, samples, preset, pad_id=0, lr=1e-3, step=0, minibatch_size=MINIBATCH
    )
    assert max(rows for _, rows, _ in seen) == MINIBATCH
    assert max(numel for _, _, numel in seen) == micro_logits * MINIBATCH // MICRO


def test_micro_batch_size_is_validated():
    with pytest.raises(ValueError, match=r"micro_batch_size \(16\) must be at most minibatch_size"):
        LMLearnerSettings(model_path="m", minibatch_size=8, micro_batch_size=16)
    assert LMLearnerSettings(model_path="m", minibatch_size=8, micro_batch_size=3)
    job = LM_JOBS["grpo"].settings
    with pytest.raises(ValueError, match="micro_batch_size") as info:
        job.model_validate({"minibatch_size": 8, "micro_batch_size": 9, "init_model": "tiny"})
    assert info.value.errors()[0]["loc"] == ("micro_batch_size",)  # type: ignore[attr-defined]
    settings = job.model_validate({"minibatch_size": 8, "micro_batch_size": 2})
    learner = next(e for e in LM_JOBS["grpo"].expand(settings, "r") if e["name"] == "learner")
    assert learner["settings"]["micro_batch_size"] == 2
    with pytest.raises(ValueError, match="micro_batch_size"):
        lm_update(None, None, [], resolve_preset("grpo"), pad_id=0, lr=1e-3, step=0,  # type: ignore[arg-type]
                  minibatch_size=4, micro_batch_size=5)  # fmt: skip


# ------------------------------------------------------------------ through DeepSpeed


def _recording(engine) -> list[torch.Tensor]:
    """Record the gradient the engine's torch optimizer steps with (after DeepSpeed reduced,
    accumulated and clipped it): the module's under ZeRO 0, the flat fp32 partition's under 1/2."""
    opt = engine.ds.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the client AdamW
    grads: list[torch.Tensor] = []
    step = inner.step

    def recorded(*args: Any, **kwargs: Any) -> Any:
        grads.append(_flat_grads([p for g in inner.param_groups for p in g["params"]]))
        return step(*args, **kwargs)

    inner.step = recorded
    return grads


@pytest.mark.slow  # DeepSpeed engines (a few seconds each)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_deepspeed_accumulates_micro_batches_into_one_step(tok_model, zero_stage):
    """DeepSpeed (gradient_accumulation_steps 1) neither rescales the micro-batches' losses nor
    steps before the minibatch's end: the gradient it steps with, and the weights after, are the
    minibatch's at once."""
    from learner.engine import build_engine
    from learner.settings import DeepSpeedSettings, OptimizerSettings

    tok, base = tok_model
    preset = resolve_preset("dapo")
    samples = _samples(tok, base, chord=False)
    learner = _moved(base, 0.01)
    grads, weights = {}, {}
    for micro in (None, MICRO):
        ds = DeepSpeedSettings(
            zero_stage=zero_stage, device="cpu", gradient_clipping=1.0,
            train_micro_batch_size=micro or MINIBATCH,
        )  # fmt: skip
        with build_engine(load_causal_lm_copy(learner), OptimizerSettings(lr=1e-3), ds) as engine:
            grads[micro] = _recording(engine)
            _update(engine, None, samples, preset, micro)
            weights[micro] = _flat_params(engine.module)
    assert len(grads[None]) == len(grads[MICRO]) == len(samples) // MINIBATCH
    for g_whole, g_split in zip(grads[None], grads[MICRO], strict=True):
        torch.testing.assert_close(g_split, g_whole, rtol=1e-4, atol=1e-6)
    # Adam moves each weight by about lr per step whatever the gradient's size, so the rounding
    # noise of a gradient near eps shows up as a small part of lr: allow 1% of it per step.
    torch.testing.assert_close(weights[MICRO], weights[None], rtol=0, atol=0.01 * 1e-3 * 2)
    assert not np.allclose(weights[None].numpy(), _flat_params(learner).numpy())  # it trained
