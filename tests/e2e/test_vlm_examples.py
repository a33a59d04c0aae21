"""The two vision examples as users run them, shortened: `rlfleet up examples/vlm_grpo.yaml`
(the model created by init-model, SFT on the images, vLLM sampling the images the feeder stored
by digest, packed updates with the vision parts frozen, under the launcher's NATS authorization)
and `rlfleet up examples/vlm_dpo.yaml` (its image pairs written on first use, the vision encoder
frozen). The examples' own numbers come from their full runs (their headers); these runs check
the path, not the learning."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.fixtures.launch import Up, assert_nothing_left

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def shortened(example: str, tmp_path: Path, **job: Any) -> tuple[Path, Path]:
    """The example with its run directory under ``tmp_path`` and ``job`` overriding its knobs;
    (config file, run directory)."""
    config = yaml.safe_load((ROOT / "examples" / example).read_text())
    run_dir = tmp_path / "runs" / config["run"]["name"]
    config["run"]["dir"] = str(run_dir)
    config["job"].update(job)
    path = tmp_path / example
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, run_dir


@pytest.mark.timeout(1800)
def test_vlm_grpo_example_trains_on_images_under_rlfleet_up(tmp_path: Path) -> None:
    model = tmp_path / "models" / "tiny-vision"
    config, run_dir = shortened(
        "vlm_grpo.yaml", tmp_path, model_path=str(model), total_updates=3, sft_steps=20,
        eval_count=20, eval_every=3, groups_per_update=4, freeze_vision_encoder=True,
        freeze_aligner=True,
    )  # fmt: skip
    up = Up(config, run_dir, services=["learner", "sampler-0", "rollout-0"], budget_s=1500)
    try:
        assert up.wait() == 0, up.diagnostics()
    finally:
        up.stop()
    assert_nothing_left(run_dir)
    assert (model / "config.json").is_file()  # init-model made the vision model on first use
    assert "rlfleet: run 'vlm-grpo' ok (exit 0)" in up.output
    summary = next(line for line in up.lines if re.match(r"learner: 3 updates", line))
    assert "eval accuracy" in summary, summary
    ledger = [
        json.loads(line)
        for line in (run_dir / "learner" / "applied.jsonl").read_text().splitlines()
    ]
    assert [e for e in ledger if e["status"] == "applied"] and not [
        e for e in ledger if e["status"] == "invalid"
    ]
    assert (run_dir / "final" / "processor_config.json").is_file()
    from tests.integration.test_learner_tracking import tensorboard_points

    board = tensorboard_points(run_dir / "tensorboard")
    mismatch = [value for _, value in board["rollout/mismatch_kl"]]
    # The learner scored what vLLM sampled: the same ids, pixels and biased image markers.
    assert mismatch and all(abs(v) < 1e-3 for v in mismatch), mismatch
    # The frozen vision parts went with the first version only.
    assert all(value > 0 for _, value in board["weights/sync_saved_bytes"])
    start, final = (
        load_file(model / "model.safetensors"),
        load_file(run_dir / "final" / "model.safetensors"),
    )
    frozen = [n for n in start if ".vision_model." in n or ".connector." in n]
    assert frozen and all(torch.equal(start[n], final[n]) for n in frozen)


@pytest.mark.timeout(900)
def test_vlm_dpo_example_trains_with_the_vision_encoder_frozen(tmp_path: Path) -> None:
    model, data = tmp_path / "models" / "tiny-vision", tmp_path / "data"
    pairs = {"task": "shapes", "question": "largest_colour", "count": 32, "eval_count": 16}
    config, run_dir = shortened(
        "vlm_dpo.yaml", tmp_path, model_path=str(model), data=str(data / "train.jsonl"),
        eval_data=str(data / "eval.jsonl"), make_pairs=pairs, epochs=1, checkpoint_every=1000,
    )  # fmt: skip
    up = Up(config, run_dir, services=["dpo"], budget_s=600)
    try:
        assert up.wait() == 0, up.diagnostics()
    finally:
        up.stop()
    assert_nothing_left(run_dir)
    assert "rlfleet: run 'vlm-dpo' ok (exit 0)" in up.output
    # make_pairs wrote the pairs and their images on first use.
    assert len((data / "train.jsonl").read_text().splitlines()) == 32
    assert len(list((data / "eval-images").glob("*.png"))) == 16
    assert "eval loss 0.693 ->" in up.output
    start, final = (
        load_file(model / "model.safetensors"),
        load_file(run_dir / "final" / "model.safetensors"),
    )
    vision = [name for name in start if ".vision_model." in name]
    assert vision and all(torch.equal(start[n], final[n]) for n in vision)
    assert any(not torch.equal(start[n], final[n]) for n in start if ".text_model." in n)
    assert (run_dir / "final" / "processor_config.json").is_file()
