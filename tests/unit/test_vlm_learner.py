"""The LM learner on a vision-language model (a real tiny Idefics3, no mocks): the prompt's pixels
ride beside its tokens through decoding, collation, row selection, packing and the update's
forward passes, which score exactly what the model's own forward does on each sequence alone;
frozen vision parts stay bit-identical, out of the optimizer and out of weight versions after the
first; SFT trains on shapes tasks' images."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common import tensor
from common.datasets import iter_tasks, take
from common.images import open_image
from learner.lm.batch import PromptPixels, Sample, collate, decode_group
from learner.lm.jobs import PRESET_NAMES
from learner.lm.model import (
    hf_weights,
    image_pixels,
    load_causal_lm,
    load_processor,
    sequence_logprobs,
    static_prefixes,
)
from learner.lm.packing import pack
from rlfleet.bus.v1 import trajectory_pb2
from rlfleet.sampler.v1 import sampler_pb2
from services.errors import InvalidArgument

TOLERANCE = 1e-5
VISION = ("model.vision_model.", "model.connector.")


@pytest.fixture(scope="module")
def vlm(vision_model_dir: Path) -> tuple[Any, Any]:
    torch.manual_seed(0)
    return load_processor(vision_model_dir), load_causal_lm(vision_model_dir)


def _image_prompt(processor: Any, count: int, seed: int) -> tuple[list[int], list[bytes]]:
    """A chat prompt showing ``count`` shapes images (0: text only): its ids as the model sees
    them (images expanded) and the images' PNG bytes."""
    tasks = take(iter_tasks({"generator": "shapes", "seed": seed}), max(count, 1))
    pngs = [t.images[0] for t in tasks][:count]
    content = [{"type": "image"} for _ in pngs] + [{"type": "text", "text": "What shapes?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    if not pngs:
        return list(processor.tokenizer(text)["input_ids"]), []
    ids = processor(text=[text], images=[[open_image(p) for p in pngs]])["input_ids"][0]
    return list(ids), pngs


def _tokens(processor: Any) -> tuple[int, int]:
    """The image placeholder and how many of them each image slot expands to."""
    return processor.image_token_id, processor.image_seq_len


def _pixels(processor: Any, pngs: list[bytes]) -> PromptPixels:
    values, mask = image_pixels(processor, [open_image(p) for p in pngs])
    return PromptPixels(values, mask, *_tokens(processor))


def _sample(processor: Any, images: int, answer: str, seed: int) -> Sample:
    prompt, pngs = _image_prompt(processor, images, seed)
    completion = processor.tokenizer(answer, add_special_tokens=False)["input_ids"]
    pixels = _pixels(processor, pngs) if pngs else None
    return Sample(
        group_id=f"g{seed}",
        prompt_ids=np.asarray(prompt, dtype=np.int64),
        completion_ids=np.asarray(completion, dtype=np.int64),
        rollout_logp=np.zeros(len(completion), dtype=np.float32),
        loss_mask=np.ones(len(completion), dtype=bool),
        reward=float(seed % 2),
        truncated=False,
        expert=False,
        policy_version=0,
        scores={},
        pixel_values=None if pixels is None else pixels.values,
        pixel_attention_mask=None if pixels is None else pixels.mask,
    )


def _alone(model: Any, s: Sample) -> torch.Tensor:
    """The model's own forward on sample ``s`` alone: logp [n-1] of each next token."""
    ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None]
    images = {}
    if s.pixel_values is not None and s.pixel_attention_mask is not None:
        images = {
            "pixel_values": torch.from_numpy(s.pixel_values)[None],
            "pixel_attention_mask": torch.from_numpy(s.pixel_attention_mask)[None],
        }
    with torch.no_grad():
        logits = model(input_ids=ids, **images).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0]


def _mixed_samples(processor: Any) -> list[Sample]:
    """Rows of two, one and no images, of different lengths."""
    return [
        _sample(processor, 2, "a red square", 1),
        _sample(processor, 1, "left", 2),
        _sample(processor, 0, "no image here at all", 3),
        _sample(processor, 1, "the right one", 4),
    ]


def test_logprobs_with_images_equal_each_rows_own_forward(vlm: tuple[Any, Any]) -> None:
    processor, model = vlm
    samples = _mixed_samples(processor)
    batch = collate(samples, processor.tokenizer.pad_token_id)
    assert batch.pixel_values is not None and batch.pixel_attention_mask is not None
    assert tuple(batch.pixel_values.shape) == (4, 2, 3, 64, 64)
    assert not batch.pixel_values[1, 1].any() and not batch.pixel_values[2].any()  # padding
    with torch.no_grad():
        logp, _ = sequence_logprobs(
            model, batch.input_ids, batch.attention_mask,
            pixel_values=batch.pixel_values, pixel_attention_mask=batch.pixel_attention_mask,
        )  # fmt: skip
    for row, s in enumerate(samples):
        own = _alone(model, s)
        assert torch.allclose(logp[row, : len(own)], own, atol=TOLERANCE, rtol=0), row
    # Selected rows carry only the image slots they use; a text-only selection none.
    some = batch.select(torch.tensor([1, 2]))
    assert some.pixel_values is not None and some.pixel_values.shape[1] == 1
    assert batch.select(torch.tensor([2])).pixel_values is None
    with torch.no_grad():
        sub, _ = sequence_logprobs(
            model, some.input_ids, some.attention_mask,
            pixel_values=some.pixel_values, pixel_attention_mask=some.pixel_attention_mask,
        )  # fmt: skip
    own = _alone(model, samples[1])
    assert torch.allclose(sub[0, : len(own)], own, atol=TOLERANCE, rtol=0)


def test_packed_forward_with_images_equals_padded(vlm: tuple[Any, Any]) -> None:
    processor, model = vlm
    samples = [*_mixed_samples(processor), _sample(processor, 1, "up", 5)]
    batch = collate(samples, processor.tokenizer.pad_token_id)
    budget = int(batch.attention_mask.sum(-1).max()) * 2
    packed = pack(batch.input_ids, batch.attention_mask, budget)
    assert packed.input_ids.shape[0] < len(samples)  # sequences share rows
    counted = torch.arange(batch.input_ids.shape[1] - 1)[None] < (
        batch.attention_mask.sum(-1, keepdim=True) - 1
    )
    weights = torch.randn(counted.shape, generator=torch.Generator().manual_seed(0))

    def run(pack_tokens: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logp, ent = sequence_logprobs(
            model, batch.input_ids, batch.attention_mask, entropy_grad=True,
            pack_tokens=pack_tokens, pixel_values=batch.pixel_values,
            pixel_attention_mask=batch.pixel_attention_mask,
        )  # fmt: skip
        assert ent is not None
        loss = ((logp * weights + 0.01 * ent) * counted).sum() / counted.sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return torch.where(counted, logp, 0).detach(), grads

    logp_padded, grads_padded = run(None)
    logp_packed, grads_packed = run(budget)
    model.zero_grad()
    assert torch.allclose(logp_packed, logp_padded, atol=TOLERANCE, rtol=0)
    assert grads_packed.keys() == grads_padded.keys()
    assert any(name.startswith(VISION) for name in grads_padded)  # the images were trained on
    for name, grad in grads_padded.items():
        assert torch.allclose(grads_packed[name], grad, atol=TOLERANCE, rtol=0), name


def _group(processor: Any, images: int, gid: str) -> tuple[trajectory_pb2.TrajectoryGroup, list]:
    prompt, pngs = _image_prompt(processor, images, seed=7)
    msg = trajectory_pb2.TrajectoryGroup(
        run="t", group_id=gid, prompt_id=gid, policy_version=0,
        prompt_token_ids=tensor.encode(np.asarray(prompt, np.int32)),
        image_sha256=[hashlib.sha256(p).hexdigest() for p in pngs],
    )  # fmt: skip
    for text, reward in (("left", 1.0), ("right", 0.0)):
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        msg.completions.append(
            trajectory_pb2.TrajectoryCompletion(
                token_ids=tensor.encode(np.asarray(ids, np.int32)),
                logprobs=tensor.encode(np.full(len(ids), -1.0, np.float32)),
                finish_reason=sampler_pb2.FINISH_REASON_STOP,
                reward=reward,
                policy_version=0,
            )
        )
    return msg, pngs


def test_decode_checks_the_groups_images(vlm: tuple[Any, Any]) -> None:
    processor, _ = vlm
    vocab = len(processor.tokenizer)
    msg, pngs = _group(processor, 1, "one")
    with pytest.raises(InvalidArgument, match=r"image_sha256.*text only") as text_only:
        decode_group(msg, vocab)  # a text model's learner passes no pixels
    assert text_only.value.field == "image_sha256"
    samples = decode_group(msg, vocab, _pixels(processor, pngs))
    assert all(
        s.pixel_values is not None and s.pixel_values.shape == (1, 3, 64, 64) for s in samples
    )
    two = _pixels(processor, [pngs[0], pngs[0]])  # more images than the prompt has room for
    with pytest.raises(InvalidArgument, match=r"image_sha256.*holds") as mismatch:
        decode_group(msg, vocab, two)
    assert mismatch.value.field == "image_sha256"
    # A text prompt on a vision-language model: no pixels, and no placeholder may appear.
    none = PromptPixels(np.zeros(0, np.float32), np.zeros(0, bool), *_tokens(processor))
    text, _ = _group(processor, 0, "text")
    assert all(s.pixel_values is None for s in decode_group(text, vocab, none))
    unnamed = trajectory_pb2.TrajectoryGroup()
    unnamed.CopyFrom(msg)
    del unnamed.image_sha256[:]
    with pytest.raises(InvalidArgument, match=r"image_sha256: 0 images .* holds 16"):
        decode_group(unnamed, vocab, none)  # placeholders, but no image named
    # A sampled placeholder has no image to fill it: the forward could not score it.
    placeholder = trajectory_pb2.TrajectoryGroup()
    placeholder.CopyFrom(msg)
    ids = np.asarray([5, processor.image_token_id], np.int32)
    placeholder.completions[1].token_ids.CopyFrom(tensor.encode(ids))
    placeholder.completions[1].logprobs.CopyFrom(tensor.encode(np.zeros(2, np.float32)))
    with pytest.raises(InvalidArgument, match="image token") as sampled:
        decode_group(placeholder, vocab, _pixels(processor, pngs))
    assert sampled.value.field == "completions[1].token_ids"


def _built(model: Path, **settings: Any) -> tuple[Any, Any]:
    """An LM learner workload on ``model`` (small minibatches, a high learning rate) and its
    engine, built from seed 0."""
    from learner.lm.settings import LMLearnerSettings
    from learner.lm.workload import LMWorkload
    from services.registry import ServiceContext

    config = LMLearnerSettings.model_validate({
        "model_path": str(model), "device": "cpu", "minibatch_size": 4, "learning_rate": 1e-2,
        **settings,
    })  # fmt: skip
    workload = LMWorkload(ServiceContext("learner", "lm_learner", config), config)
    torch.manual_seed(0)
    return workload, workload.build()


def _is_vision(name: str) -> bool:
    """A parameter of the vision parts, by its Hugging Face or peft name."""
    return any(f".{part}" in f".{name}" for part in VISION)


@pytest.mark.slow  # a DeepSpeed engine
@pytest.mark.parametrize(
    "knobs",
    [{"freeze_vision_encoder": True, "freeze_aligner": True}, {"lora": {"r": 2}}],
    ids=["frozen", "lora"],
)
def test_vision_parts_that_do_not_train_stay_put_and_travel_once(
    vision_model_dir: Path, knobs: dict[str, Any]
) -> None:
    from learner.workload import Progress

    workload, engine = _built(vision_model_dir, preset="grpo", algo={"kl_beta": 0.04}, **knobs)
    try:
        module = engine.module
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        vision = {n for n in before if _is_vision(n)}
        trained = {n for n, p in module.named_parameters() if p.requires_grad}
        assert vision and trained and not vision & trained
        in_optimizer = {id(p) for g in engine.ds.optimizer.param_groups for p in g["params"]}
        assert {n for n, p in module.named_parameters() if id(p) in in_optimizer} == trained

        first = workload.weights()  # the first version carries everything
        static = {n for n in first if n.startswith(VISION)}
        assert static
        processor = workload.processor
        items = []
        for gid in ("a", "b"):
            msg, pngs = _group(processor, 1, gid)
            items += decode_group(msg, workload.vocab_size, _pixels(processor, pngs))
        metrics = workload.train(items, Progress(), torch.Generator().manual_seed(0))
        assert np.isfinite(metrics["losses/loss"])
        after = dict(module.named_parameters())
        for name in set(before) - trained:
            assert torch.equal(after[name], before[name]), name
        assert all(not torch.equal(after[n], before[n]) for n in trained if "lora_A" not in n)

        later = workload.weights()  # later versions leave the vision parts out
        assert set(later) == set(first) - static
        sizes = {n: t.numel() * t.element_size() for n, t in first.items()}
        report = workload.report(items, metrics, Progress(), 1.0)
        assert report["weights/sync_bytes"] == sum(sizes[n] for n in later)
        assert report["weights/sync_saved_bytes"] == sum(sizes[n] for n in static)
    finally:
        engine.close()


def test_lora_on_a_vlm_adapts_the_text_model_only(vision_model_dir: Path) -> None:
    from learner.lm.settings import LoraSettings

    model = load_causal_lm(vision_model_dir, lora=LoraSettings(r=2))
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n and ".text_model." in n for n in adapters)
    # The vision parts never train under LoRA: later versions need not carry them.
    assert static_prefixes(model) == list(VISION)
    weights = hf_weights(model, skip=static_prefixes(model))
    assert weights and not any(n.startswith(VISION) or "lora_" in n for n in weights)


def test_freezing_a_text_model_names_the_knob(tiny_model_dir: Path) -> None:
    from pydantic import ValidationError

    from learner.lm.settings import LMLearnerSettings

    with pytest.raises(ValueError, match="freeze_vision_encoder"):
        load_causal_lm(tiny_model_dir, freeze_vision_encoder=True)
    with pytest.raises(ValidationError, match=r"freeze_aligner: .* is a text model"):
        LMLearnerSettings.model_validate(
            {"model_path": str(tiny_model_dir), "device": "cpu", "freeze_aligner": True}
        )


def test_sft_on_shapes_images_reduces_the_loss(vision_model_dir: Path) -> None:
    from learner.lm.sft import expert_sample, expert_samples, sft_phase
    from tests.unit.test_lm_learner import PlainEngine

    torch.manual_seed(0)
    processor = load_processor(vision_model_dir)
    model = load_causal_lm(vision_model_dir)
    tokenizer = processor.tokenizer
    tasks = iter_tasks({"generator": "shapes"}, split="train")
    first = expert_sample(next(tasks), tokenizer, processor=processor)
    assert first.pixel_values is not None and first.pixel_values.shape == (1, 3, 64, 64)
    assert int((first.prompt_ids == processor.image_token_id).sum()) == processor.image_seq_len
    with pytest.raises(ValueError, match="has images"):
        expert_sample(next(tasks), tokenizer)  # without a processor: text only
    history = sft_phase(
        PlainEngine(model), tokenizer, expert_samples(tasks, tokenizer, processor),
        steps=8, batch_size=4, learning_rate=3e-3, log_every=1,
    )  # fmt: skip
    losses = [h["sft/loss"] for h in history]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.slow  # a DeepSpeed engine per preset
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_trains_on_image_groups(vision_model_dir: Path, preset: str) -> None:
    """Each GRPO-family preset's update runs on groups with images: finite loss, the text model
    moves (expert completions for CHORD come from the same groups)."""
    from learner.workload import Progress

    workload, engine = _built(vision_model_dir, preset=preset, packing=True)
    try:
        module = engine.module
        before = {
            n: p.detach().clone() for n, p in module.named_parameters() if ".text_model." in n
        }
        items = []
        for gid in ("a", "b"):
            msg, pngs = _group(workload.processor, 1, gid)
            items += decode_group(msg, workload.vocab_size, _pixels(workload.processor, pngs))
        metrics = workload.train(items, Progress(), torch.Generator().manual_seed(0))
        assert np.isfinite(metrics["losses/loss"]), metrics
        after = dict(module.named_parameters())
        assert any(not torch.equal(after[n], t) for n, t in before.items())
    finally:
        engine.close()
