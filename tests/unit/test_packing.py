"""Sequence packing (learner/lm/packing.py): the packed forward gives the unpacked log-probs,
entropies, loss and gradients (to 1e-5) on a real model, with fewer rows and no sequence
attending to another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.lm.model import sequence_logprobs
from learner.lm.packing import pack, packed_logprobs
from tests.unit.test_lm_learner import tok_model

__all__ = ["tok_model"]  # the shared fixture (a tiny real model and its tokenizer)

TOLERANCE = 1e-5


def _batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random sequences of the given lengths: input_ids, attention_mask [B, L]."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, vocab, (n,), generator=generator)
        mask[row, :n] = 1
    return ids, mask


def test_pack_fills_rows_first_fit_and_keeps_sequences_apart() -> None:
    ids, mask = _batch([9, 3, 7, 2, 12, 5], vocab=50)
    p = pack(ids, mask, budget=12)
    assert p.input_ids.shape[0] < len(ids) and p.input_ids.shape[1] <= 12
    for b, n in enumerate(mask.sum(-1).tolist()):
        row, start = int(p.row[b]), int(p.start[b])
        assert torch.equal(p.input_ids[row, start : start + n], ids[b, :n])
        assert torch.equal(p.position_ids[row, start : start + n], torch.arange(n))
        block = p.attention_mask[row, 0, start : start + n, start : start + n]
        assert torch.equal(block, torch.tril(torch.ones((n, n), dtype=torch.bool)))
        # nothing outside its own block, before or after it
        assert p.attention_mask[row, 0, start : start + n].sum() == n * (n + 1) // 2
    oversized = pack(*_batch([20, 4], vocab=50), budget=12)
    assert oversized.input_ids.shape == (2, 20)  # a longer sequence gets a row of its own


def test_packed_logprobs_loss_and_gradients_equal_unpacked(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lengths = [17, 5, 30, 9, 12, 24, 3, 8]
    ids, mask = _batch(lengths, vocab=model.config.vocab_size)
    counted = torch.arange(ids.shape[1] - 1)[None, :] < (mask.sum(-1, keepdim=True) - 1)
    weights = torch.randn(counted.shape)  # a stand-in for advantages

    def loss_and_grads(packed: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        if packed:
            logp, ent = packed_logprobs(model, ids, mask, budget=40, entropy_grad=True)
        else:
            logp, ent = sequence_logprobs(model, ids, mask, entropy_grad=True)
        assert ent is not None
        loss = ((logp * weights + 0.01 * ent) * counted).sum() / counted.sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), torch.where(counted, logp, 0).detach(), grads

    loss_u, logp_u, grads_u = loss_and_grads(packed=False)
    loss_p, logp_p, grads_p = loss_and_grads(packed=True)
    assert torch.allclose(logp_p, logp_u, atol=TOLERANCE, rtol=0)
    assert abs(loss_p.item() - loss_u.item()) <= TOLERANCE
    assert grads_p.keys() == grads_u.keys()
    for name, grad in grads_u.items():
        assert torch.allclose(grads_p[name], grad, atol=TOLERANCE, rtol=0), name
    assert pack(ids, mask, budget=40).input_ids.shape[0] < len(lengths)


@pytest.mark.parametrize("entropy", [True, False])
def test_no_grad_passes_pack_too(tiny_model_dir: Path, entropy: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids, mask = _batch([6, 11, 4], vocab=model.config.vocab_size, seed=1)
    with torch.no_grad():
        logp, ent = packed_logprobs(model, ids, mask, budget=32, entropy=entropy)
        want, _ = sequence_logprobs(model, ids, mask, entropy=False)
    counted = torch.arange(ids.shape[1] - 1)[None, :] < (mask.sum(-1, keepdim=True) - 1)
    assert torch.allclose(logp[counted], want[counted], atol=TOLERANCE, rtol=0)
    assert (ent is None) != entropy


# ------------------------------------------------------------------ in the LM update


@pytest.mark.parametrize(("case", "micro"), [("grpo", None), ("chord", None), ("dapo", 2)])
def test_a_packed_update_trains_as_the_padded_one(tok_model, case: str, micro: int | None) -> None:
    """The whole update (pi_old recomputed, the reference's log-probs, the training passes, with
    and without micro-batches): the same gradients and metrics with ``pack_tokens``."""
    from learner.algos.presets import resolve_preset
    from learner.lm.update import lm_update
    from tests.unit.test_lm_learner import _moved, load_causal_lm_copy
    from tests.unit.test_lm_micro_batch import CASES, MINIBATCH, SGDEngine, _flat_params, _samples

    tok, base = tok_model
    name, overrides = CASES[case]
    preset = resolve_preset(name, **overrides)
    samples = _samples(tok, base, preset.chord)
    learner = _moved(base, 0.01)
    reference = load_causal_lm_copy(base).eval() if preset.kl_beta > 0 else None
    engines, metrics = {}, {}
    for pack_tokens in (None, 64):
        engine = SGDEngine(load_causal_lm_copy(learner))
        metrics[pack_tokens] = lm_update(
            engine, reference, samples, preset, pad_id=0, lr=0.05, step=3,
            minibatch_size=MINIBATCH, micro_batch_size=micro, version=1,
            generator=torch.Generator().manual_seed(7), pack_tokens=pack_tokens,
        )  # fmt: skip
        engines[pack_tokens] = engine
    padded, packed = engines[None], engines[64]
    for g_padded, g_packed in zip(padded.grads, packed.grads, strict=True):
        torch.testing.assert_close(g_packed, g_padded, rtol=1e-4, atol=TOLERANCE)
    torch.testing.assert_close(
        _flat_params(packed.module), _flat_params(padded.module), rtol=1e-5, atol=1e-7
    )
    for key, value in metrics[None].items():
        assert metrics[64][key] == pytest.approx(value, rel=1e-4, abs=TOLERANCE), key


def test_packing_is_a_job_knob_the_learner_gets() -> None:
    from learner.lm.jobs import LM_JOBS

    job = LM_JOBS["grpo"]
    settings = job.settings.model_validate({"packing": True})
    learner = next(e for e in job.expand(settings, "r") if e["name"] == "learner")
    assert learner["settings"]["packing"] is True
