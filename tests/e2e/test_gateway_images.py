"""Images through the OpenAI API on real parts: `rlfleet init-model --vision`, then `rlfleet
export` (which writes the processor, so the folder loads with AutoProcessor and
AutoModelForImageTextToText), then `rlfleet up` of a `serve` job on the vLLM engine, and the
official `openai` client asks about a data-URL image, non-streaming and streaming. The quantized
exports of the vision model (w8a8, w4a16: the text model only) load in vLLM and see the image;
AWQ is refused for it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.datasets import iter_tasks, take
from learner.export import export
from services.errors import ConfigError
from services.ports import free_port
from tests.e2e.test_serve_workflow import KEY, _cli, _wait_healthy, serve_config, stop_up

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

QUESTION = "Which colour is the largest shape?"


@pytest.fixture(scope="module")
def vision_model(vision_model_dir: Path) -> Path:
    """The session's tiny vision-language model (tests/fixtures/models.py)."""
    return vision_model_dir


@pytest.fixture(scope="module")
def exported(vision_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exports") / "tiny-vlm"
    export(vision_model, out, progress=False)
    return out


def image_url() -> str:
    """A `shapes` scene (the generator's PNG bytes) as a data URL."""
    (task,) = take(iter_tasks({"generator": "shapes"}), 1)
    return "data:image/png;base64," + base64.b64encode(task.images[0]).decode()


def test_export_writes_the_processor(exported: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    manifest = json.loads((exported / "rlfleet_export.json").read_text())
    assert "processor_config.json" in manifest["files"]
    assert "chat_template.jinja" in manifest["files"]
    processor = AutoProcessor.from_pretrained(exported)
    model = AutoModelForImageTextToText.from_pretrained(exported)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert "<image>" in text and model.config.model_type == "idefics3"


def test_export_of_a_final_folder_takes_the_processor_from_the_base_model(
    vision_model: Path, tmp_path: Path
) -> None:
    """The learner's final/ holds the tokenizer only; the run's base model has the rest."""
    final = tmp_path / "final"
    shutil.copytree(vision_model, final)
    for name in ("processor_config.json", "chat_template.jinja"):
        (final / name).unlink()
    config = tmp_path / "run.yaml"  # not beside final/: only --config names it
    job = {"kind": "grpo", "model_path": str(vision_model), "device": "cpu"}
    config.write_text(yaml.safe_dump({"run": {"name": "vlm", "dir": str(tmp_path)}, "job": job}))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"missing its processor: processor_config\.json"):
        export(final, out, progress=False)  # no run config: no base model to take it from
    export(final, out, config=config, progress=False)
    assert (out / "processor_config.json").is_file() and (out / "chat_template.jinja").is_file()


def test_awq_is_refused_for_a_vision_model(vision_model: Path, tmp_path: Path) -> None:
    from learner.export.quantize import quantize

    with pytest.raises(ConfigError, match=r"vision-language model .* AWQ"):
        quantize(vision_model, tmp_path / "out", "w4a16-awq", ["calibration text"])


@pytest.mark.timeout(900)  # the quantizer environment on first use, then a vLLM start
# w8a8, whose SmoothQuant mappings are the vision-specific part; w4a16 differs only in the
# scheme's name here (the text model's w4a16 is exported and served by test_serve_workflow).
@pytest.mark.parametrize("scheme", ["w8a8"])
def test_quantized_vision_export_answers_in_vllm(
    vision_model: Path, tmp_path: Path, scheme: str
) -> None:
    """The text model quantized, the vision parts in full precision, the processor kept: vLLM
    loads the folder and expands the image to its patch tokens."""
    from transformers import AutoProcessor

    out = tmp_path / scheme
    manifest = export(
        vision_model,
        out,
        quantize=scheme,
        calibration_dataset={"generator": "shapes"},
        calibration_samples=16,
        progress=False,
    )
    assert manifest["quantization"]["vision_model"] is True
    config = json.loads((out / "config.json").read_text())
    ignored = config["quantization_config"]["ignore"]
    assert "lm_head" in ignored and "model.connector.modality_projection.proj" in ignored
    assert any(".vision_model." in name for name in ignored)
    assert not any(".text_model." in name for name in ignored)

    (task,) = take(iter_tasks({"generator": "shapes"}), 1)
    image = tmp_path / "image.png"
    image.write_bytes(task.images[0])
    processor = AutoProcessor.from_pretrained(out)
    prompt = processor.apply_chat_template(list(task.messages), add_generation_prompt=True)
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    request.write_text(
        json.dumps(
            {
                "model": str(out),
                "prompts": [prompt],
                "max_tokens": 4,
                "images": [[str(image)]],
                "dtype": "bfloat16",  # the CPU int kernels take no float32 activations
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "learner.export.vllm_probe", str(request), str(result)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(result.read_text())
    assert answer["quantization"] == "compressed-tensors"
    (greedy,) = answer["greedy"]
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    image_seq_len = json.loads((vision_model / "rlfleet_model.json").read_text())["image_seq_len"]
    assert greedy["prompt_token_ids"].count(image_id) == image_seq_len
    assert greedy["token_ids"]


@pytest.mark.timeout(1800)  # a vLLM start, minutes under load
def test_openai_client_asks_about_an_image(exported: Path, tmp_path: Path) -> None:
    import openai

    port = free_port()
    config = serve_config(tmp_path, "serve-images", exported, "tiny-vlm", port, engine="vllm")
    log = (tmp_path / "up.log").open("w")
    up = _cli("up", str(config), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", up, tmp_path / "up.log", timeout_s=900)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        url = image_url()
        content = [
            {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
            {"type": "text", "text": QUESTION},
        ]
        asked = {"model": "tiny-vlm", "max_tokens": 8, "temperature": 0}
        answer = client.chat.completions.create(
            messages=[{"role": "user", "content": content}], **asked
        )
        text = answer.choices[0].message.content
        assert text and answer.usage.completion_tokens > 0
        # The image reached the model as its patch tokens, not as text.
        plain = client.chat.completions.create(
            messages=[{"role": "user", "content": QUESTION}], **asked
        )
        image_seq_len = json.loads((exported / "rlfleet_model.json").read_text())["image_seq_len"]
        assert answer.usage.prompt_tokens - plain.usage.prompt_tokens >= image_seq_len

        chunks = list(
            client.chat.completions.create(
                messages=[{"role": "user", "content": content}],
                stream=True,
                stream_options={"include_usage": True},
                **asked,
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text  # greedy: the same answer either way
        assert chunks[-1].usage.prompt_tokens == answer.usage.prompt_tokens

        too_many = [{"type": "image_url", "image_url": {"url": url}}] * 5
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                messages=[{"role": "user", "content": too_many}], **asked
            )
        assert refused.value.body["param"] == "messages[0].content[4]"
    finally:
        stop_up(up, log, tmp_path / "up.log")
