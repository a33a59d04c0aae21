"""`rlfleet init-model --vision`: a tiny Idefics3 written through the real save paths loads in
transformers (processor and model) and in vLLM's CPU engine, which sees the same prompt tokens
(each image expanded to its patch tokens) and gives the same log-probabilities on the same
pixels."""

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

pytestmark = pytest.mark.slow  # a vLLM engine in a subprocess

ROOT = Path(__file__).resolve().parents[2]
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides; the research measured agreement far below


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


def test_vllm_sees_the_same_tokens_and_gives_the_same_logprobs(
    vision_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vision_model)
    tasks = take(iter_tasks({"generator": "shapes", "split": "eval"}), 3)
    prompts = [
        processor.apply_chat_template(list(t.messages), add_generation_prompt=True) for t in tasks
    ]
    images = []
    for i, task in enumerate(tasks):
        path = tmp_path / f"{i}.png"
        path.write_bytes(task.images[0])
        images.append([str(path)])
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    probe = {"model": str(vision_model), "prompts": prompts, "images": images, "max_tokens": 6}
    request.write_text(json.dumps({**probe, "max_model_len": 512, "dtype": "float32"}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "learner.export.vllm_probe", str(request), str(result)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(result.read_text())["greedy"]

    model = AutoModelForImageTextToText.from_pretrained(vision_model).eval()
    for text, task, answer in zip(prompts, tasks, answers, strict=True):
        pixels = [[open_image(task.images[0])]]
        inputs = processor(text=[text], images=pixels, return_tensors="pt")
        assert answer["prompt_token_ids"] == inputs["input_ids"][0].tolist()
        ids = torch.tensor([answer["prompt_token_ids"] + answer["token_ids"]])
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                pixel_values=inputs["pixel_values"],
                pixel_attention_mask=inputs["pixel_attention_mask"],
            ).logits
        start = len(answer["prompt_token_ids"])
        logp = torch.log_softmax(logits[0, start - 1 : -1].float(), dim=-1)
        ours = logp.gather(1, torch.tensor(answer["token_ids"])[:, None])[:, 0]
        assert torch.allclose(ours, torch.tensor(answer["logprobs"]), atol=LOGPROB_TOLERANCE), (
            ours.tolist(),
            answer["logprobs"],
        )
