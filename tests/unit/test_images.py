"""Images in datasets: references (files, data URLs) resolved to PNG bytes with clear errors,
JSONL rows with image parts, the `shapes` generator (held-out scenes, answers the pixels
support), and the chat template's image parts."""

from __future__ import annotations

import base64
import io
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from common.datasets import DatasetSpecError, iter_tasks, shared_prompts, take
from common.images import (
    IMAGE_PART,
    MAX_IMAGE_BYTES,
    ImageError,
    count_images,
    decode_data_url,
    open_image,
    read_image,
)
from common.shapes import COLOURS, QUESTIONS


def _png(colour: tuple[int, int, int] = (255, 0, 0), size: tuple[int, int] = (8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_files_and_data_urls_become_the_same_png_pixels(tmp_path: Path) -> None:
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 6), (0, 0, 255)).save(jpeg, format="JPEG")
    (tmp_path / "a.jpg").write_bytes(jpeg.getvalue())
    from_file = read_image("a.jpg", tmp_path)
    assert from_file.startswith(b"\x89PNG")
    assert open_image(from_file).size == (8, 6)
    assert read_image(_data_url(_png()), tmp_path) == _png()


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("https://example.com/cat.png", "remote image"),
        ("missing.png", "No such file"),
        ("data:text/plain;base64,aGk=", "not a base64 image data URL"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a readable"),
    ],
)
def test_bad_references_name_what_is_wrong(tmp_path: Path, reference: str, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        read_image(reference, tmp_path)


def test_oversized_images_are_refused(tmp_path: Path) -> None:
    (tmp_path / "big.png").write_bytes(b"\0" * (MAX_IMAGE_BYTES + 1))
    with pytest.raises(ImageError, match="over"):
        read_image("big.png", tmp_path)
    with pytest.raises(ImageError, match="over"):
        decode_data_url("data:image/png;base64," + "A" * (MAX_IMAGE_BYTES * 2))


def test_jsonl_rows_with_images(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(_png((255, 0, 0)))
    rows = [
        {"messages": [{"role": "user", "content": [
            {"type": "image", "image": "img/red.png"},
            {"type": "image_url", "image_url": {"url": _data_url(_png((0, 255, 0)))}},
            {"type": "text", "text": "Which is red?"},
        ]}], "answer": "first"},
        {"messages": [{"role": "user", "content": "no image"}], "answer": "x"},
    ]  # fmt: skip
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    first, second = take(iter_tasks({"jsonl": str(path)}), 2)
    content = first.messages[0]["content"]
    assert content == [IMAGE_PART, IMAGE_PART, {"type": "text", "text": "Which is red?"}]
    assert count_images(first.messages) == len(first.images) == 2
    assert open_image(first.images[0]).getpixel((0, 0)) == (255, 0, 0)
    assert open_image(first.images[1]).getpixel((0, 0)) == (0, 255, 0)
    assert first.extra == {"answer": "first"}
    assert second.images == () and second.messages[0]["content"] == "no image"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image", "image": "gone.png"}], r"data.jsonl:1: messages\[0\]: image file"),
        ([{"type": "video", "video": "a.mp4"}], r"data.jsonl:1: messages\[0\]: content part 0"),
        ([], r"data.jsonl:1: messages\[0\]: content must be"),
        (None, r"data.jsonl:1: messages\[0\]: content must be"),
    ],
)
def test_bad_image_rows_name_line_message_and_part(
    tmp_path: Path, content: object, message: str
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": content}]}) + "\n")
    with pytest.raises(DatasetSpecError, match=message):
        take(iter_tasks({"jsonl": str(path)}), 1)


def test_shapes_scenes_are_reproducible_and_held_out_scenes_never_train() -> None:
    spec = {"generator": "shapes", "seed": 3}
    first, again = take(iter_tasks(spec), 20), take(iter_tasks(spec), 20)
    assert [t.images for t in first] == [t.images for t in again]
    held_out = take(iter_tasks(spec, split="eval"), 100)
    assert shared_prompts(iter_tasks(spec), held_out, limit=3000) == (0, 100)
    # The question's text is the same for every scene: only the pixels tell the answer.
    texts = {json.dumps(t.messages) for t in take(iter_tasks(spec), 300)}
    assert len(texts) == len(QUESTIONS)


def test_shapes_answers_cover_every_value_and_match_the_pixels() -> None:
    tasks = take(iter_tasks({"generator": "shapes", "question": "largest_colour"}), 60)
    assert set(Counter(t.extra["answer"] for t in tasks)) == set(COLOURS)
    for task in tasks:
        image = open_image(task.images[0])
        assert image.size == (64, 64)
        counts = Counter(image.get_flattened_data())
        by_colour = {name: counts[rgb] for name, rgb in COLOURS.items()}
        assert max(by_colour, key=by_colour.__getitem__) == task.extra["answer"]
        assert task.solution == f"<answer>{task.extra['answer']}</answer>"
    counts = Counter(
        t.extra["answer"]
        for t in take(iter_tasks({"generator": "shapes", "question": "count_circles"}), 200)
    )
    assert set(counts) == {"0", "1", "2", "3"}


def test_bad_shapes_specs_are_clear() -> None:
    with pytest.raises(DatasetSpecError, match="unknown question 'colours'"):
        take(iter_tasks({"generator": "shapes", "question": "colours"}), 1)
    with pytest.raises(DatasetSpecError, match=r"size must be in \[32, 512\]"):
        take(iter_tasks({"generator": "shapes", "size": 8}), 1)


def test_the_chat_template_renders_one_image_token_per_image_part() -> None:
    from jinja2 import Template

    from common.models import CHAT_TEMPLATE, IMAGE_TOKEN

    template = Template(CHAT_TEMPLATE)
    parts = [IMAGE_PART, {"type": "text", "text": "What is it?"}, IMAGE_PART]
    text = template.render(
        messages=[{"role": "user", "content": parts}], add_generation_prompt=True
    )
    assert text == f"<|im_start|>user\n{IMAGE_TOKEN}What is it?{IMAGE_TOKEN}<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    plain = template.render(messages=[{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"
