"""DPO on a vision-language model: preference pairs about images (rlfleet dpo-data --task
shapes) train with the pixels, the vision parts frozen, packed and padded alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.lm.dpo import DPOTrainer
from learner.lm.dpo_data import shapes_pairs, write_pairs
from learner.lm.dpo_job import DPOSettings

pytestmark = pytest.mark.slow  # real DPO runs on the tiny vision model


@pytest.fixture(scope="module")
def image_pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pairs") / "train.jsonl"
    write_pairs(out, shapes_pairs(16, out.parent / "train-images"))
    return out


def settings(model: Path, data: Path, **knobs: object) -> DPOSettings:
    return DPOSettings.model_validate(
        {
            "model_path": str(model), "data": str(data), "max_length": 64, "beta": 0.5,
            "epochs": 3, "batch_size": 8, "learning_rate": 1e-3, "precision": "fp32",
            "zero_stage": 0, "device": "cpu", "log_every": 100, "checkpoint_every": 1000,
            **knobs,
        }
    )  # fmt: skip


def test_dpo_fits_image_pairs_with_the_vision_parts_frozen(
    vision_model_dir: Path, image_pairs: Path, tmp_path: Path
) -> None:
    s = settings(
        vision_model_dir, image_pairs, eval_data=str(image_pairs),
        freeze_vision_encoder=True, freeze_aligner=True,
    )  # fmt: skip
    trainer = DPOTrainer(s, tmp_path / "run")
    try:
        vision = {
            n: p.detach().clone()
            for n, p in trainer.engine.module.named_parameters()
            if ".vision_model." in n or ".connector." in n
        }
        chosen, rejected, _ = trainer._logps(trainer.engine, trainer.train_pairs[:2])
        # The pixels reach the forward: the same pairs without their images score otherwise.
        saved, trainer._pixels = trainer._pixels, {}
        blind, _, _ = trainer._logps(trainer.engine, trainer.train_pairs[:2])
        trainer._pixels = saved
        assert not torch.allclose(chosen, blind, atol=1e-3)
        result = trainer.run()
        after = dict(trainer.engine.module.named_parameters())
        assert all(torch.equal(after[n], before) for n, before in vision.items())
    finally:
        trainer.close()
    before, after = result.eval_before, result.eval_after  # on the pairs it trained on
    assert after["loss"] < before["loss"] - 0.1
    assert after["rewards/accuracies"] > before["rewards/accuracies"]
    final = tmp_path / "run" / "final"
    assert (final / "processor_config.json").is_file() or (
        final / "preprocessor_config.json"
    ).is_file()
    assert torch.isfinite(chosen).all() and torch.isfinite(rejected).all()


def test_packed_image_dpo_scores_as_padded(
    vision_model_dir: Path, image_pairs: Path, tmp_path: Path
) -> None:
    scores = []
    for packing in (False, True):
        trainer = DPOTrainer(settings(vision_model_dir, image_pairs, packing=packing), tmp_path)
        try:
            scores.append(trainer.ref_train)
        finally:
            trainer.close()
    assert torch.allclose(scores[0], scores[1], atol=1e-4)
