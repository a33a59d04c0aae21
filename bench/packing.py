"""Sequence packing (``packing: true``) against padding: training tokens per second of the LM
update's forward and backward pass on a realistic length mix, for the text and the vision model.

A batch is what a GRPO update trains on: ``--groups`` prompts of the task's length with
``--group-size`` completions each, the completion lengths drawn from a log-normal (most
answers short, a few long, cut at ``--max-tokens``, as sampled completions are). Padded: one
``[B, L]`` forward (``learner.lm.model.sequence_logprobs``), as every update runs without
packing. Packed: the same sequences laid end to end in rows of the model's context
(``pack_tokens``), the learner's packed path. Both sum the completion tokens' log-probs and
backpropagate, so the parameters' gradients are computed as in an update (the packed values
equal the padded ones: tests/unit/test_packing.py). Tokens/s counts real tokens only (prompt
and completion), the same in both.

The vision model's sequences each carry one shapes image (its tokens are part of the prompt).

    python -m bench.packing                     # both models, 5 timed batches each
    python -m bench.packing --models text --repeats 3

Prints a table and writes bench/results/packing.json (``packing_speedup`` per model; the
issue's target: >= 1.5).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench._shared.results import RESULTS_DIR, WORK_DIR, machine, median, write_results

RESULTS = RESULTS_DIR / "packing.json"
TARGET = 1.5


def text_model() -> Path:
    from common.models import init_model

    path = WORK_DIR / "models" / "tiny-arith"
    if not (path / "config.json").is_file():
        init_model(path, size="tiny")
    return path


def vision_model() -> Path:
    from common.models import init_vision_model

    path = WORK_DIR / "models" / "tiny-vision"
    if not (path / "config.json").is_file():
        init_vision_model(path)
    return path


def lengths(rng: np.random.Generator, count: int, a: argparse.Namespace) -> list[int]:
    """Completion lengths: log-normal around ``--median-tokens``, in [1, --max-tokens]."""
    drawn = rng.lognormal(np.log(a.median_tokens), a.sigma, size=count)
    return [int(n) for n in np.clip(drawn, 1, a.max_tokens)]


def text_batches(a: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Right-padded batches of prompt + completion token ids (random ids: the cost is the
    same), with their completion masks."""
    rng = np.random.default_rng(a.seed)
    batches = []
    for _ in range(a.repeats + 1):
        seqs = []
        for _ in range(a.groups):
            prompt = rng.integers(3, vocab, size=int(rng.integers(16, 64))).tolist()
            for n in lengths(rng, a.group_size, a):
                seqs.append((prompt, rng.integers(3, vocab, size=n).tolist()))
        batches.append(_collate(seqs))
    return batches


def vision_batches(a: argparse.Namespace, model_path: Path) -> list[dict[str, Any]]:
    """Shapes prompts (one image each, expanded by the processor) with random completions."""
    from transformers import AutoProcessor

    from common.datasets import iter_tasks, take
    from common.images import image_token_ids, open_image

    processor = AutoProcessor.from_pretrained(model_path)
    # Completions never hold image markers (samplers suppress them).
    banned = set(image_token_ids(processor))
    vocab = np.asarray([i for i in range(3, len(processor.tokenizer)) if i not in banned])
    rng = np.random.default_rng(a.seed)
    tasks = take(iter_tasks({"generator": "shapes", "seed": a.seed}), a.groups * (a.repeats + 1))
    batches = []
    for r in range(a.repeats + 1):
        seqs, pixels, pixel_masks = [], [], []
        for task in tasks[r * a.groups : (r + 1) * a.groups]:
            text = processor.apply_chat_template(list(task.messages), add_generation_prompt=True)
            enc = processor(text=[text], images=[[open_image(task.images[0])]], return_tensors="pt")
            prompt = enc["input_ids"][0].tolist()
            for n in lengths(rng, a.group_size, a):
                seqs.append((prompt, rng.choice(vocab, size=n).tolist()))
                pixels.append(enc["pixel_values"][0])
                pixel_masks.append(enc["pixel_attention_mask"][0])
        batch = _collate(seqs)
        batch["pixel_values"] = torch.stack(pixels)  # [B, 1, 3, H, W]
        batch["pixel_attention_mask"] = torch.stack(pixel_masks)  # [B, 1, H, W]
        batches.append(batch)
    return batches


def _collate(seqs: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.int64)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    for row, (prompt, completion) in enumerate(seqs):
        p, c = len(prompt), len(completion)
        ids[row, : p + c] = torch.tensor(prompt + completion)
        attention[row, : p + c] = 1
        mask[row, p - 1 : p - 1 + c] = True
    return {"input_ids": ids, "attention_mask": attention, "mask": mask}


def step_seconds(model: Any, batch: dict[str, Any], pack_tokens: int | None) -> float:
    """One forward + backward of the summed completion log-probs."""
    from learner.lm.model import sequence_logprobs

    images = {k: batch[k] for k in ("pixel_values", "pixel_attention_mask") if k in batch}
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    logp, _ = sequence_logprobs(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        entropy=False,
        pack_tokens=pack_tokens,
        **images,
    )
    (logp * batch["mask"]).sum().backward()
    return time.perf_counter() - started


def measure(name: str, model: Any, batches: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    model.train()
    tokens = [int(b["attention_mask"].sum()) for b in batches]
    step_seconds(model, batches[0], None)  # warm-up of both paths
    step_seconds(model, batches[0], budget)
    padded, packed = [], []
    for batch, count in zip(batches[1:], tokens[1:], strict=True):
        padded.append(count / step_seconds(model, batch, None))
        packed.append(count / step_seconds(model, batch, budget))
    shapes = [tuple(b["input_ids"].shape) for b in batches[1:]]
    padded_tokens = [rows * width for rows, width in shapes]
    return {
        "model": name,
        "sequences_per_batch": shapes[0][0],
        "real_tokens_per_batch": median(tokens[1:]),
        "padded_tokens_per_batch": median(padded_tokens),
        "pack_tokens": budget,
        "padded_tokens_per_s": median(padded),
        "packed_tokens_per_s": median(packed),
        "packing_speedup": median(p / q for p, q in zip(packed, padded, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["text", "vision"])
    parser.add_argument("--groups", type=int, default=4, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--median-tokens", type=float, default=48.0)
    parser.add_argument("--sigma", type=float, default=0.9, help="log-normal spread")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per model")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    torch.manual_seed(a.seed)
    rows = []
    for name in a.models:
        if name == "text":
            from transformers import AutoModelForCausalLM

            path = text_model()
            model = AutoModelForCausalLM.from_pretrained(path)
            batches = text_batches(a, model.get_input_embeddings().num_embeddings)
        else:
            from transformers import AutoModelForImageTextToText

            path = vision_model()
            model = AutoModelForImageTextToText.from_pretrained(path)
            batches = vision_batches(a, path)
        budget = int(model.config.get_text_config().max_position_embeddings)
        rows.append(measure(name, model, batches, budget))
    print(
        f"{'model':8} {'seqs':>5} {'real tok':>9} {'padded tok':>11} {'padded tok/s':>13} "
        f"{'packed tok/s':>13} {'speedup':>8}  target >= {TARGET}"
    )
    for r in rows:
        met = "met" if r["packing_speedup"] >= TARGET else "NOT met"
        print(
            f"{r['model']:8} {r['sequences_per_batch']:>5} {r['real_tokens_per_batch']:>9.0f} "
            f"{r['padded_tokens_per_batch']:>11.0f} {r['padded_tokens_per_s']:>13.0f} "
            f"{r['packed_tokens_per_s']:>13.0f} {r['packing_speedup']:>8.2f}  {met}"
        )
    write_results(
        RESULTS,
        {
            "machine": machine(),
            "settings": vars(a),
            "target_packing_speedup": TARGET,
            "models": {r["model"]: r for r in rows},
        },
    )


if __name__ == "__main__":
    main()
