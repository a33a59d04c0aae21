"""Preference pairs about images (learner/lm/dpo_data.py): images named by file or data URL are
read once, the vision-language model's processor expands them in the encoded prompt, and every
problem is named by file and line."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from common.datasets import DatasetSpecError
from learner.lm.dpo_data import encode_pair, load_pairs, shapes_pairs, write_pairs


@pytest.fixture(scope="module")
def processor(vision_model_dir: Path) -> object:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vision_model_dir)


def test_shapes_pairs_load_back_with_their_images(tmp_path: Path, processor: object) -> None:
    from common.images import open_image

    out = tmp_path / "data" / "train.jsonl"
    written = write_pairs(out, shapes_pairs(6, out.parent / "train-images", split="eval"))
    assert written == 6 and len(list((out.parent / "train-images").glob("*.png"))) == 6
    pairs = load_pairs(out)
    for pair in pairs:
        assert len(pair.images) == 1 and pair.chosen != pair.rejected
        assert pair.prompt[0]["content"][0] == {
            "type": "image"
        }  # the placeholder the template reads
    tokenizer = processor.tokenizer  # type: ignore[attr-defined]
    encoded = encode_pair(pairs[0], tokenizer, 128, processor)
    text = tokenizer.apply_chat_template(
        list(pairs[0].prompt), tokenize=False, add_generation_prompt=True
    )
    want = processor(text=[text], images=[[open_image(pairs[0].images[0])]])["input_ids"][0]  # type: ignore[operator]
    assert list(encoded.prompt) == [int(i) for i in want] and encoded.images == pairs[0].images
    assert encoded.chosen != encoded.rejected and not encoded.truncated


def test_a_data_url_image_is_read_and_a_missing_file_named(tmp_path: Path) -> None:
    png = next(iter(shapes_pairs(1, tmp_path / "img")))["prompt"][0]["content"][0]["image"]
    data = (tmp_path / png).read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    by_url = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Which?"}]
    missing = [{"type": "image", "image": "nowhere.png"}]
    rows = [
        {"prompt": [{"role": "user", "content": content}], "chosen": "a", "rejected": "b"}
        for content in (by_url, missing)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    assert load_pairs(path)[0].images == (data,)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(DatasetSpecError, match=r"pairs.jsonl:2: prompt\[0\]: .*nowhere.png"):
        load_pairs(path)


def test_images_need_a_vision_model_and_are_never_cut(tmp_path: Path, processor: object) -> None:
    out = tmp_path / "train.jsonl"
    write_pairs(out, shapes_pairs(1, tmp_path / "train-images"))
    pair = load_pairs(out)[0]
    tokenizer = processor.tokenizer  # type: ignore[attr-defined]
    with pytest.raises(DatasetSpecError, match="reads text only"):
        encode_pair(pair, tokenizer, 128)
    with pytest.raises(DatasetSpecError, match="images are never cut"):
        encode_pair(pair, tokenizer, 24, processor)
