"""`rlfleet init-model --vision`: a tiny Idefics3 written through the real save paths loads in
transformers (processor and model) and answers about an image. That vLLM's CPU engine sees the
same prompt tokens and gives the same log-probabilities on the same pixels is checked through
the sampler itself (tests/contract/test_sampler_images.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.datasets import iter_tasks, take
from common.images import open_image

pytestmark = pytest.mark.slow  # init-model in a subprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vlm") / "tiny-vlm"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "launch", "init-model", str(out), "--vision"],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


def test_the_folder_loads_in_transformers_and_answers_about_an_image(vision_model: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    facts = json.loads((vision_model / "rlfleet_model.json").read_text())
    assert facts["image_seq_len"] == 16 and facts["vision"]["image_size"] == 64
    processor = AutoProcessor.from_pretrained(vision_model)
    model = AutoModelForImageTextToText.from_pretrained(vision_model)
    assert facts["parameters"] == sum(p.numel() for p in model.parameters())
    task = take(iter_tasks({"generator": "shapes"}), 1)[0]
    text = processor.apply_chat_template(list(task.messages), add_generation_prompt=True)
    inputs = processor(text=[text], images=[[open_image(task.images[0])]], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert inputs["input_ids"][0].tolist().count(image_id) == facts["image_seq_len"]
    assert tuple(inputs["pixel_values"].shape) == (1, 1, 3, 64, 64)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[-1] == len(processor.tokenizer) and torch.isfinite(logits).all()
